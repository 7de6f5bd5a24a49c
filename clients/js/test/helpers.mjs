// Shared by the tests: a recording fake fetch, a real HTTP stand-in, small images made
// here, the test photos, user folders of the test's own.

import { createHmac } from "node:crypto";
import { mkdtempSync, readFileSync, writeFileSync } from "node:fs";
import { createServer } from "node:http";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { deflateSync } from "node:zlib";

/** tests/data of the repository (the espresso photo and the cat). */
export const DATA = fileURLToPath(new URL("../../../tests/data/", import.meta.url));
export const coffee = () => readFileSync(`${DATA}coffee.jpg`);
export const chelsea = () => readFileSync(`${DATA}chelsea.jpg`);

/** The JSON error body every vramguard error has. */
export function errorResponse(status, code, message = `${code} happened`, headers = {}) {
  return new Response(JSON.stringify({ error: { code, message } }),
    { status, headers: { "content-type": "application/json", ...headers } });
}

export function jsonResponse(body, status = 200, headers = {}) {
  return new Response(JSON.stringify(body),
    { status, headers: { "content-type": "application/json", ...headers } });
}

export const CLASSIFIED = { model: "efficientnet_lite0", batch_size: 1, cached: false,
  predictions: [{ label: "espresso", index: 967, score: 0.95 }], timing_ms: { total: 1 } };

/** A fake fetch: `answer(call, n)` gives the Response of the n-th call (0-based), or a
 * promise of one; every call is recorded with its time. A pending answer rejects when
 * the request's signal aborts, as a real fetch does. */
export function fakeFetch(answer) {
  const calls = [];
  const fetch = async (url, init) => {
    const call = { url, init, at: performance.now(), aborted: false,
      headers: new Headers(init.headers) };
    calls.push(call);
    const reply = Promise.resolve(answer(call, calls.length - 1));
    return new Promise((resolve, reject) => {
      const onAbort = () => {
        call.aborted = true;
        reject(new DOMException("This operation was aborted", "AbortError"));
      };
      if (init.signal?.aborted) onAbort();
      init.signal?.addEventListener("abort", onAbort, { once: true });
      reply.then(resolve, reject);
    });
  };
  return { fetch, calls };
}

export const delay = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

const CRC_TABLE = Array.from({ length: 256 }, (_, n) => {
  let c = n;
  for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
  return c >>> 0;
});

function crc32(bytes) {
  let c = 0xffffffff;
  for (const b of bytes) c = CRC_TABLE[(c ^ b) & 0xff] ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}

function chunk(type, data) {
  const out = Buffer.alloc(12 + data.length);
  out.writeUInt32BE(data.length, 0);
  out.write(type, 4, "ascii");
  data.copy(out, 8);
  out.writeUInt32BE(crc32(out.subarray(4, 8 + data.length)), 8 + data.length);
  return out;
}

/** A valid RGB PNG of `size`×`size` pixels, a colour gradient seeded by `seed`. */
export function makePng(size = 48, seed = 0) {
  const header = Buffer.alloc(13);
  header.writeUInt32BE(size, 0);
  header.writeUInt32BE(size, 4);
  header[8] = 8; // bit depth
  header[9] = 2; // RGB
  const raw = Buffer.alloc(size * (1 + size * 3));
  for (let y = 0; y < size; y++) {
    const row = y * (1 + size * 3);
    for (let x = 0; x < size; x++) {
      raw[row + 1 + x * 3] = (x * 5 + seed * 40) & 0xff;
      raw[row + 2 + x * 3] = (y * 5 + seed * 90) & 0xff;
      raw[row + 3 + x * 3] = ((x + y) * 3 + seed * 20) & 0xff;
    }
  }
  return Buffer.concat([Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]),
    chunk("IHDR", header), chunk("IDAT", deflateSync(raw)), chunk("IEND", Buffer.alloc(0))]);
}

/** Point this test process at empty user folders of its own (no VRAMGUARD_* variables),
 * so that a vramguard running on this computer is never found; the config folder. */
export function isolateUserFolders() {
  const home = mkdtempSync(join(tmpdir(), "vramguard-js-"));
  for (const name of Object.keys(process.env)) {
    if (name.startsWith("VRAMGUARD_")) delete process.env[name];
  }
  Object.assign(process.env, { HOME: home, XDG_CONFIG_HOME: join(home, "config"),
    LOCALAPPDATA: join(home, "local") });
  return process.platform === "win32" ? join(home, "local", "vramguard")
    : process.platform === "darwin" ? join(home, "Library", "Application Support", "vramguard")
      : join(home, "config", "vramguard");
}

/** A real HTTP server on 127.0.0.1 (a free port) answering each request with
 * `answer(request, n)`: `{ status, headers, body }`. Resolves to `{ url, port, requests,
 * close }`; `requests` records each one's method, url and time. */
export async function standIn(answer) {
  const requests = [];
  const server = createServer((request, response) => {
    request.resume();
    request.on("end", () => {
      requests.push({ method: request.method, url: request.url, at: performance.now() });
      const { status = 200, headers = {}, body = {} } = answer(request, requests.length - 1);
      response.writeHead(status, { "content-type": "application/json", ...headers });
      response.end(JSON.stringify(body));
    });
  });
  await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
  const { port } = server.address();
  return { url: `http://127.0.0.1:${port}`, port, requests,
    close: () => new Promise((resolve) => server.close(resolve)) };
}

/** The packed bytes of the loopback addresses, written out (the proof binds them). */
export const LOOPBACK_BYTES = { "127.0.0.1": [127, 0, 0, 1], "::1": [...Array(15).fill(0), 1] };

/** A private admin token file at `path` holding `token`. */
export function writeToken(path, token = "s3cret-token") {
  writeFileSync(path, `${token}\n`, { mode: 0o600 });
  return token;
}

/** A real HTTP server on `host` (a free port) that answers POST /v1/identity the way a
 * vramguard holding `token` and listening at `proves` (an address of LOOPBACK_BYTES;
 * default: where it really listens) does, and everything else with `answer(request)`:
 * `{ status, body }`. `requests` records each one's url and Authorization header. */
export async function provingStandIn(token, { host = "127.0.0.1", proves = host,
  answer = () => ({ body: CLASSIFIED }) } = {}) {
  const requests = [];
  let port = 0;
  const server = createServer((request, response) => {
    const chunks = [];
    request.on("data", (chunk) => chunks.push(chunk));
    request.on("end", () => {
      requests.push({ method: request.method, url: request.url,
        authorization: request.headers.authorization });
      let status = 200;
      let body;
      if (request.url === "/v1/identity") {
        const nonce = Buffer.from(JSON.parse(Buffer.concat(chunks).toString()).nonce, "hex");
        const address = Buffer.from(LOOPBACK_BYTES[proves]);
        const message = Buffer.concat([nonce, Buffer.from([address.length]), address,
          Buffer.from([port >> 8, port & 0xff])]);
        body = { proof: createHmac("sha256", token).update(message).digest("hex") };
      } else {
        ({ status = 200, body = {} } = answer(request));
      }
      response.writeHead(status, { "content-type": "application/json" });
      response.end(JSON.stringify(body));
    });
  });
  await new Promise((resolve) => server.listen(0, host, resolve));
  port = server.address().port;
  const url = host.includes(":") ? `http://[${host}]:${port}` : `http://${host}:${port}`;
  return { url, port, requests, close: () => new Promise((resolve) => server.close(resolve)) };
}
