// vramguard JavaScript client: an ES module on `fetch` (Node 18+, Electron, browsers).
// No dependencies. The public API is declared in index.d.ts; README.md explains it.

import { findServer, locate } from "./discovery.js";
import { identityProof, proofModules, readToken } from "./identity.js";
import {
  errorFromResponse,
  retryWaitMs,
  sniffContentType,
  transportError,
  PACED,
  JITTER,
  NotRunning,
  NotVramguard,
  Timeout,
  UnexpectedResponse,
} from "./internal.js";

export {
  VramguardError,
  BadImage,
  BadRequest,
  Unauthorized,
  Forbidden,
  NotFound,
  MethodNotAllowed,
  RequestTimeout,
  Conflict,
  PayloadTooLarge,
  ImageTooLarge,
  UnsupportedMediaType,
  ImageTooComplex,
  RateLimited,
  ClientClosed,
  InternalError,
  Unavailable,
  Overloaded,
  DeadlineExceeded,
  NotReady,
  Loading,
  Paused,
  InsufficientMemory,
  NotRunning,
  NotVramguard,
  ConnectionLost,
  Timeout,
  UnexpectedResponse,
  ERROR_CLASSES,
  sniffContentType,
} from "./internal.js";
export { findServer } from "./discovery.js";

export const DEFAULT_URL = "http://127.0.0.1:8765";

const now = () => (typeof performance !== "undefined" ? performance.now() : Date.now());
const MAX_TIMER_MS = 2147483647; // setTimeout fires at once beyond this

/** Resolve after `ms`, or reject with the signal's reason when it aborts first. */
function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) {
      reject(signal.reason);
      return;
    }
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal.reason);
    };
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, Math.min(Math.max(0, ms), MAX_TIMER_MS));
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

/** Resolve once now() has reached `target` (timers may fire a little early). */
async function sleepUntil(target, signal) {
  for (let left = target - now(); left > 0; left = target - now()) {
    await sleep(Math.ceil(left), signal);
  }
}

/** The image as a fetch body and its Content-Type (sniffed from its first bytes). */
// By shape, not instanceof: a Blob or ArrayBuffer from another realm (an iframe, an
// Electron context, a Node vm) is not an instance of this realm's class.
const isBlob = (value) => value != null && typeof value === "object" &&
  typeof value.arrayBuffer === "function" && typeof value.slice === "function" &&
  typeof value.size === "number" && typeof value.type === "string";
const isArrayBuffer = (value) => ["[object ArrayBuffer]", "[object SharedArrayBuffer]"]
  .includes(Object.prototype.toString.call(value));

async function imageBody(image) {
  if (isBlob(image)) {
    const head = new Uint8Array(await image.slice(0, 16).arrayBuffer());
    let type = sniffContentType(head);
    if (type === "application/octet-stream" && /^image\//i.test(image.type)) type = image.type;
    return { body: image, contentType: type };
  }
  let bytes;
  if (isArrayBuffer(image)) bytes = new Uint8Array(image);
  else if (image instanceof Uint8Array) bytes = image; // a Node Buffer is one too
  else if (ArrayBuffer.isView(image)) {
    bytes = new Uint8Array(image.buffer, image.byteOffset, image.byteLength);
  } else {
    throw new TypeError("image must be a Blob/File, an ArrayBuffer, a Uint8Array or a " +
      `Buffer, not ${image === null ? "null" : typeof image}`);
  }
  return { body: bytes, contentType: sniffContentType(bytes) };
}

function query(params) {
  const parts = [];
  for (const [name, value] of Object.entries(params)) {
    if (value !== undefined && value !== null) {
      parts.push(`${name}=${encodeURIComponent(String(value))}`);
    }
  }
  return parts.length ? `?${parts.join("&")}` : "";
}

export class Client {
  #fetch;
  #given; // the url option, or null: then the appliance is found (in Node)
  #found = null; // a promise of the location found, once per client (again after a move)
  #holdUntil = 0; // performance.now() ms before which no image request leaves
  #tokenFile = null; // the admin token file of the appliance found (Node)
  #proven = null; // the found appliance's url, once it proved itself

  /**
   * @param {object} [options]
   * @param {string} [options.url] the appliance; without it, found as findServer() says
   * @param {number} [options.timeoutMs] overall deadline of one call, retries included
   * @param {typeof fetch} [options.fetch] the fetch to use (default globalThis.fetch)
   * @param {string} [options.clientId] sent as X-Client-Id: a rate-limit bucket of its own
   * @param {number} [options.maxRetries] most retries of one call (default 10)
   */
  constructor({ url, timeoutMs = 60000, fetch = globalThis.fetch, clientId,
    maxRetries = 10 } = {}) {
    if (typeof fetch !== "function") {
      throw new TypeError("no fetch: use Node 18 or later, or pass options.fetch");
    }
    if (!(timeoutMs > 0)) throw new RangeError("timeoutMs must be a positive number");
    if (!(Number.isInteger(maxRetries) && maxRetries >= 0)) {
      throw new RangeError("maxRetries must be a whole number, 0 or more");
    }
    if (clientId !== undefined && !/^[A-Za-z0-9._-]{1,64}$/.test(clientId)) {
      throw new RangeError("clientId: 1 to 64 of A-Z a-z 0-9 . _ - (the server ignores others)");
    }
    this.#given = url === undefined || url === null ? null : String(url).replace(/\/+$/, "");
    /** Where the appliance is and how that was found: "argument" (the url option),
     * "instance", "config" or "default"; found at the first call. */
    this.location = this.#given === null
      ? { url: DEFAULT_URL, source: "default" } : { url: this.#given, source: "argument" };
    this.timeoutMs = timeoutMs;
    this.clientId = clientId;
    this.maxRetries = maxRetries;
    // Called without a receiver: a browser's window.fetch stored on an object and
    // called as a method throws "Illegal invocation".
    this.#fetch = (input, init) => fetch(input, init);
  }

  /** The appliance's address (see `location`). */
  get url() {
    return this.location.url;
  }

  /** The most likely classes of one image (POST /v1/classify); for a multilabel model,
   * every label scored above `threshold` (the model's own when omitted). */
  async classify(image, { topK, model, keepAlive, threshold, signal, timeoutMs } = {}) {
    const { body, contentType } = await imageBody(image);
    const path = `/v1/classify${query({ top_k: topK, model, keep_alive: keepAlive, threshold })}`;
    return this.#send("POST", path, { body, contentType, signal, timeoutMs, paced: true });
  }

  /** The image's L2-normalised features (POST /v1/embed). */
  async embed(image, { model, keepAlive, signal, timeoutMs } = {}) {
    const { body, contentType } = await imageBody(image);
    const path = `/v1/embed${query({ model, keep_alive: keepAlive })}`;
    return this.#send("POST", path, { body, contentType, signal, timeoutMs, paced: true });
  }

  /** Every model this install can serve (GET /v1/models). */
  async models({ signal, timeoutMs } = {}) {
    return this.#send("GET", "/v1/models", { signal, timeoutMs });
  }

  /** The memory report (GET /v1/memory). */
  async memory({ signal, timeoutMs } = {}) {
    return this.#send("GET", "/v1/memory", { signal, timeoutMs });
  }

  /**
   * Classify many images, at most `concurrency` at a time; yields one item per input as
   * each finishes (not in input order): `{index, image, ok: true, result}` or
   * `{index, image, ok: false, error}`. A failed image never ends the stream.
   */
  async *classifyStream(images, { concurrency = 4, onProgress, signal, ...options } = {}) {
    if (!(Number.isInteger(concurrency) && concurrency >= 1)) {
      throw new RangeError("concurrency must be a whole number, 1 or more");
    }
    if (images == null) throw new TypeError("images must be an array or an iterable");
    const total = typeof images.length === "number" ? images.length : undefined;
    const source = typeof images[Symbol.asyncIterator] === "function"
      ? images[Symbol.asyncIterator]()
      : typeof images[Symbol.iterator] === "function" ? images[Symbol.iterator]() : null;
    if (source === null) throw new TypeError("images must be an array or an iterable");
    // Requests still running when the consumer stops early (break, return, throw) are
    // cancelled; so are all of them when the caller's signal aborts.
    if (signal?.aborted) throw signal.reason;
    const stop = new AbortController();
    const onAbort = () => stop.abort(signal.reason);
    signal?.addEventListener("abort", onAbort, { once: true });
    const running = new Map();
    let started = 0;
    let exhausted = false;
    let done = 0;
    try {
      for (;;) {
        while (!exhausted && running.size < concurrency) {
          const step = await source.next();
          if (step.done) {
            exhausted = true;
            break;
          }
          const index = started++;
          const image = step.value;
          running.set(index, this.classify(image, { ...options, signal: stop.signal })
            .then((result) => ({ index, image, ok: true, result }),
              (error) => ({ index, image, ok: false, error })));
        }
        if (running.size === 0) return;
        const item = await Promise.race(running.values());
        running.delete(item.index);
        if (signal?.aborted) throw signal.reason;
        done += 1;
        onProgress?.(done, total);
        yield item;
      }
    } finally {
      signal?.removeEventListener("abort", onAbort);
      if (running.size) stop.abort(new Error("classifyStream stopped"));
      if (!exhausted) await source.return?.();
    }
  }

  /** One call with its retries, within one deadline; the answer's JSON object. */
  async #send(method, path, { body, contentType, signal, timeoutMs = this.timeoutMs,
    paced = false } = {}) {
    if (signal?.aborted) throw signal.reason;
    const deadline = now() + timeoutMs;
    const headers = { Accept: "application/json" };
    if (contentType) headers["Content-Type"] = contentType;
    if (this.clientId) headers["X-Client-Id"] = this.clientId;
    await this.#locate(false);
    let mayFollow = this.#given === null; // to a found appliance that moved, once a call
    for (let tries = 1; ; tries++) {
      // A hold the server put on this client (a 429, overloaded or not_ready answer to
      // any of its image requests): wait it out, jittered; it may grow meanwhile.
      for (let left = this.#holdUntil - now(); paced && left > 0; left = this.#holdUntil - now()) {
        const wait = left + Math.random() * JITTER * left;
        if (now() + wait >= deadline) {
          throw new Timeout(`vramguard asked this client to wait ${(left / 1000).toFixed(1)} s, ` +
            `longer than what is left of this call's ${timeoutMs} ms timeout.`);
        }
        await sleepUntil(now() + wait, signal);
      }
      const remaining = deadline - now();
      if (remaining <= 0) throw this.#timeout(timeoutMs);
      const abort = new AbortController();
      const timer = setTimeout(() => abort.abort(), Math.min(remaining, MAX_TIMER_MS));
      const onAbort = () => abort.abort();
      signal?.addEventListener("abort", onAbort, { once: true });
      let error;
      try {
        error = paced ? await this.#prove(headers, abort.signal) : null;
        if (error === null) {
          const response = await this.#fetch(this.url + path,
            { method, headers, body, signal: abort.signal });
          const text = await response.text();
          if (response.ok) return parseAnswer(text, response.status);
          error = errorFromResponse(response.status, response.headers, text);
        }
      } catch (cause) {
        if (signal?.aborted) throw signal.reason;
        if (abort.signal.aborted) throw this.#timeout(timeoutMs);
        if (cause instanceof UnexpectedResponse || cause instanceof NotVramguard) throw cause;
        error = transportError(cause, this.url);
      } finally {
        clearTimeout(timer);
        signal?.removeEventListener("abort", onAbort);
      }
      if (mayFollow && error instanceof NotRunning) {
        mayFollow = false;
        const before = this.url;
        if ((await this.#locate(true)) !== before) continue; // restarted elsewhere: go there
      }
      const wait = tries > this.maxRetries ? null : retryWaitMs(error, tries);
      if (wait === null || now() + wait >= deadline) throw error;
      const retryAt = now() + wait;
      if (paced && PACED.has(error.code)) this.#holdUntil = Math.max(this.#holdUntil, retryAt);
      await sleepUntil(retryAt, signal);
    }
  }

  /** Find the appliance (when no url was given): at the first call, and again (`again`)
   * when nothing answers where it was; the address in use. */
  async #locate(again) {
    if (this.#given !== null) return this.url;
    if (this.#found === null || again) {
      this.#found = locate().then(({ tokenFile, ...location }) => {
        this.location = location;
        this.#tokenFile = tokenFile;
        return location;
      });
    }
    return (await this.#found).url;
  }

  /** Before images go to an appliance this client found (in Node; once per place it is
   * found at): its proof that it knows this user's admin token at the address and port
   * reached. null once proven (or nothing to prove: a given url, a browser); the error
   * to retry for a busy answer (429, 503); NotVramguard thrown when it cannot prove. */
  async #prove(headers, signal) {
    const url = this.url;
    if (this.#given !== null || this.#proven === url || this.#tokenFile === null) return null;
    const modules = await proofModules();
    if (modules === null) return null;
    const nonce = modules.crypto.randomBytes(32);
    const response = await this.#fetch(`${url}/v1/identity`, { method: "POST",
      headers: { ...headers, "Content-Type": "application/json" },
      body: JSON.stringify({ nonce: nonce.toString("hex") }), signal });
    const text = await response.text();
    if (response.status === 429 || response.status === 503) {
      return errorFromResponse(response.status, response.headers, text);
    }
    let proof = null;
    try {
      proof = JSON.parse(text)?.proof;
    } catch {
      // not vramguard's answer: refused below
    }
    const token = readToken(modules, this.#tokenFile, url);
    const { hostname, port } = new URL(url);
    const expected = identityProof(modules, token, nonce, hostname, Number(port) || 80);
    if (!response.ok || typeof proof !== "string" || proof.length !== expected.length ||
        !modules.crypto.timingSafeEqual(Buffer.from(proof), Buffer.from(expected))) {
      throw new NotVramguard(`The program answering at ${url} cannot prove it is your ` +
        "vramguard (or it uses another admin-token file); no image was sent to it.");
    }
    this.#proven = url;
    return null;
  }

  #timeout(timeoutMs) {
    return new Timeout(`No answer within the call's ${timeoutMs} ms timeout (retries included).`);
  }
}

function parseAnswer(text, status) {
  let body;
  try {
    body = JSON.parse(text);
  } catch {
    body = undefined;
  }
  if (body === null || typeof body !== "object" || Array.isArray(body)) {
    throw new UnexpectedResponse(`not vramguard's answer: ${String(text).slice(0, 200)}`, { status });
  }
  return body;
}

export default Client;
