// The client against an injected fake fetch: requests, error mapping, retry rules,
// deadlines, classifyStream. No server needed.

import assert from "node:assert/strict";
import { describe, it } from "node:test";

import * as vg from "../index.js";
import { askedSeconds, retryAfterSeconds, retryWaitMs } from "../internal.js";
import {
  CLASSIFIED, coffee, delay, errorResponse, fakeFetch, isolateUserFolders, jsonResponse,
  makePng, standIn,
} from "./helpers.mjs";

const { VramguardError } = vg;
isolateUserFolders(); // a Client without url finds nothing running: the default address
/** These tests are about requests, not discovery: each client names the default address
 * (a client that finds it must first have it prove itself: identity.test.mjs). */
class Client extends vg.Client {
  constructor(options = {}) {
    super({ url: vg.DEFAULT_URL, ...options });
  }
}
const JPEG = new Uint8Array([0xff, 0xd8, 0xff, 0xe0, 0, 16, 0x4a, 0x46, 0x49, 0x46]);

// Every code the server answers (app/errors.py, app/gates/rate_limit.py), as the README's
// errors table documents it.
const DOCUMENTED = [
  [400, "bad_image", "BadImage"],
  [400, "bad_request", "BadRequest"],
  [401, "unauthorized", "Unauthorized"],
  [403, "forbidden", "Forbidden"],
  [404, "not_found", "NotFound"],
  [405, "method_not_allowed", "MethodNotAllowed"],
  [408, "request_timeout", "RequestTimeout"],
  [409, "conflict", "Conflict"],
  [413, "payload_too_large", "PayloadTooLarge"],
  [413, "image_too_large", "ImageTooLarge"],
  [415, "unsupported_media_type", "UnsupportedMediaType"],
  [422, "image_too_complex", "ImageTooComplex"],
  [429, "rate_limited", "RateLimited"],
  [499, "client_closed", "ClientClosed"],
  [500, "internal_error", "InternalError"],
  [503, "overloaded", "Overloaded"],
  [503, "deadline_exceeded", "DeadlineExceeded"],
  [503, "paused", "Paused"],
  [503, "not_ready", "NotReady"],
  [503, "loading", "Loading"],
  [503, "insufficient_memory", "InsufficientMemory"],
];

describe("requests", () => {
  it("sends the image as the raw body with its sniffed type and the options as query", async () => {
    const { fetch, calls } = fakeFetch(() => jsonResponse(CLASSIFIED));
    const client = new Client({ url: "http://127.0.0.1:9999/", fetch, clientId: "my-app" });
    const image = coffee();
    const result = await client.classify(image, { topK: 3, model: "efficientnet_lite1", keepAlive: -1 });
    assert.deepEqual(result, CLASSIFIED);
    const [call] = calls;
    assert.equal(call.url, "http://127.0.0.1:9999/v1/classify?top_k=3&model=efficientnet_lite1&keep_alive=-1");
    assert.equal(call.init.method, "POST");
    assert.equal(call.headers.get("content-type"), "image/jpeg");
    assert.equal(call.headers.get("x-client-id"), "my-app");
    assert.deepEqual(Buffer.from(call.init.body), image);
  });

  it("leaves out options not given; embed, models and memory use their routes", async () => {
    const { fetch, calls } = fakeFetch(() => jsonResponse({ ok: 1 }));
    const client = new Client({ fetch });
    await client.classify(JPEG);
    await client.embed(JPEG, { model: "efficientnet_lite2" });
    await client.models();
    await client.memory();
    assert.deepEqual(calls.map((c) => `${c.init.method} ${c.url}`), [
      "POST http://127.0.0.1:8765/v1/classify",
      "POST http://127.0.0.1:8765/v1/embed?model=efficientnet_lite2",
      "GET http://127.0.0.1:8765/v1/models",
      "GET http://127.0.0.1:8765/v1/memory",
    ]);
    assert.equal(calls[2].init.body, undefined);
    assert.equal(calls[0].headers.get("x-client-id"), null);
  });

  it("a multilabel model's answer: its labels and threshold; threshold only when given", async () => {
    const tags = [{ label: "dog", index: 3, score: 0.91 }, { label: "grass", index: 7, score: 0.62 }];
    const tagged = { ...CLASSIFIED, model: "my-tagger", predictions: tags, labels: tags, threshold: 0.4 };
    const { fetch, calls } = fakeFetch((call) => jsonResponse(
      call.url.includes("my-tagger") ? tagged : { ...CLASSIFIED, labels: null, threshold: null }));
    const client = new Client({ fetch });
    const result = await client.classify(JPEG, { model: "my-tagger", threshold: 0.4 });
    assert.deepEqual(result.labels, tags);
    assert.deepEqual(result.predictions, result.labels);
    assert.equal(result.threshold, 0.4);
    const single = await client.classify(JPEG, { topK: 2 });
    assert.equal(single.labels, null);
    assert.equal(single.threshold, null);
    const streamed = [];
    for await (const item of client.classifyStream([JPEG, JPEG], { model: "my-tagger", threshold: 0.25 })) {
      streamed.push(item.result);
    }
    assert.ok(streamed.every((r) => r.labels.length === 2));
    assert.deepEqual(calls.map((c) => c.url.replace("http://127.0.0.1:8765", "")), [
      "/v1/classify?model=my-tagger&threshold=0.4",
      "/v1/classify?top_k=2",
      "/v1/classify?model=my-tagger&threshold=0.25",
      "/v1/classify?model=my-tagger&threshold=0.25",
    ]);
  });

  it("models() says each model's task, format and labels; classify on an embed model is BadRequest", async () => {
    const listed = { models: [{ name: "my-embedder", state: "available", family: "own", input_size: 224,
      installed: true, note: "", task: "embed", format: "onnx", labels: 0 }] };
    const { fetch } = fakeFetch((call) => (call.url.endsWith("/v1/models") ? jsonResponse(listed)
      : errorResponse(400, "bad_request", "The model my-embedder gives image features only")));
    const client = new Client({ fetch });
    const [embedder] = (await client.models()).models;
    assert.deepEqual([embedder.task, embedder.format, embedder.labels], ["embed", "onnx", 0]);
    await assert.rejects(client.classify(JPEG, { model: "my-embedder" }), vg.BadRequest);
  });

  it("accepts a Blob, an ArrayBuffer, a Uint8Array, a Buffer and other views", async () => {
    const { fetch, calls } = fakeFetch(() => jsonResponse(CLASSIFIED));
    const client = new Client({ fetch });
    const png = makePng(8);
    const gif = new TextEncoder().encode("GIF89a....");
    const webp = Buffer.from("RIFF\x10\0\0\0WEBPVP8 ", "latin1");
    const bmp = new DataView(new TextEncoder().encode("xxBM....").buffer, 2);
    const tiffLE = new Uint8Array([0x49, 0x49, 0x2a, 0x00, 8, 0, 0, 0]).buffer;
    const tiffBE = new Uint8Array([0x4d, 0x4d, 0x00, 0x2a, 0, 0, 0, 8]);
    const inputs = [
      [new Blob([JPEG]), "image/jpeg"],
      [new Blob([JPEG], { type: "image/png" }), "image/jpeg"], // the bytes win
      [new Blob([new Uint8Array([1, 2, 3])], { type: "image/x-portable-anymap" }), "image/x-portable-anymap"],
      [new Blob([new Uint8Array([1, 2, 3])]), "application/octet-stream"],
      [png.buffer.slice(png.byteOffset, png.byteOffset + png.byteLength), "image/png"],
      [gif, "image/gif"],
      [webp, "image/webp"],
      [bmp, "image/bmp"],
      [tiffLE, "image/tiff"],
      [tiffBE, "image/tiff"],
      [new Uint8Array([0xff, 0xd8]), "application/octet-stream"], // too short for JPEG
      [new Uint8Array(0), "application/octet-stream"],
    ];
    for (const [image] of inputs) await client.classify(image);
    assert.deepEqual(calls.map((c) => c.headers.get("content-type")), inputs.map(([, t]) => t));
    // A Buffer that is a view into a larger pool sends its own bytes only.
    const pooled = Buffer.from(png); // small Buffers share one pool
    const sent = calls[4].init.body;
    assert.equal(sent.byteLength, png.byteLength);
    await client.classify(pooled.subarray(0, 20));
    assert.deepEqual(Buffer.from(calls.at(-1).init.body), png.subarray(0, 20));
    // A DataView's bytes, not its whole buffer.
    assert.deepEqual([...calls[7].init.body], [...new TextEncoder().encode("BM....")]);
  });

  it("accepts bytes and Blobs from another realm (an iframe, an Electron context, a vm)", async () => {
    const { runInNewContext } = await import("node:vm");
    const { fetch, calls } = fakeFetch(() => jsonResponse(CLASSIFIED));
    const client = new Client({ fetch });
    const foreign = runInNewContext("new Uint8Array([0xff, 0xd8, 0xff, 1])");
    const foreignBuffer = runInNewContext("new Uint8Array([0x89, 0x50, 0x4e, 0x47, 13, 10, 26, 10]).buffer");
    const blobLike = { size: 4, type: "", slice: (a, b) => new Blob([JPEG]).slice(a, b),
      arrayBuffer: () => new Blob([JPEG]).arrayBuffer() };
    await client.classify(foreign);
    await client.classify(foreignBuffer);
    await client.classify(blobLike);
    assert.deepEqual(calls.map((c) => c.headers.get("content-type")), ["image/jpeg", "image/png", "image/jpeg"]);
  });

  it("refuses what is not image bytes before any request", async () => {
    const { fetch, calls } = fakeFetch(() => jsonResponse(CLASSIFIED));
    const client = new Client({ fetch });
    for (const bad of ["/path/to/file.jpg", null, undefined, 42, { data: JPEG }]) {
      await assert.rejects(client.classify(bad), TypeError);
    }
    assert.equal(calls.length, 0);
  });

  it("checks its options", () => {
    assert.throws(() => new Client({ fetch: null }), TypeError);
    assert.throws(() => new Client({ timeoutMs: 0 }), RangeError);
    assert.throws(() => new Client({ clientId: "has space" }), RangeError);
    assert.throws(() => new Client({ maxRetries: -1 }), RangeError);
    const client = new Client();
    assert.equal(client.url, "http://127.0.0.1:8765");
    assert.equal(client.timeoutMs, 60000);
    assert.equal(vg.DEFAULT_URL, "http://127.0.0.1:8765");
  });

  it("calls the given fetch without a receiver (browsers' fetch needs that)", async () => {
    let receiver = "unset";
    const fetch = function (url, init) {
      receiver = this;
      return Promise.resolve(jsonResponse({ models: [] }));
    };
    await new Client({ fetch }).models();
    assert.equal(receiver, undefined);
  });
});

describe("errors", () => {
  for (const [status, code, name] of DOCUMENTED) {
    it(`${status} ${code} -> ${name}`, async () => {
      const headers = status === 503 || status === 429
        ? { "retry-after": "7", "ratelimit-limit": "100", "ratelimit-reset": "2" } : {};
      const { fetch, calls } = fakeFetch(() => errorResponse(status, code, `the ${code} message`, headers));
      // Within the deadline no retry fits (Retry-After 7 s > 1 s): the error comes at once.
      const client = new Client({ fetch, timeoutMs: 1000 });
      const error = await client.classify(JPEG).then(() => assert.fail("no error"), (e) => e);
      assert.equal(calls.length, 1);
      assert.ok(error instanceof vg[name], `${error.name} is not ${name}`);
      assert.ok(error instanceof VramguardError);
      assert.ok(error instanceof Error);
      assert.equal(error.name, name);
      assert.equal(error.code, code);
      assert.equal(error.status, status);
      assert.equal(error.message, `the ${code} message`);
      assert.equal(error.retryAfter, headers["retry-after"] ? 7 : null);
      assert.equal(vg[name].code, code);
      assert.equal(vg[name].status, status);
      assert.equal(vg.ERROR_CLASSES[code], vg[name]);
      if (name === "RateLimited") {
        assert.equal(error.limit, 100);
        assert.equal(error.reset, 2);
      }
    });
  }

  it("maps every code the client knows, and only those", () => {
    assert.deepEqual(Object.keys(vg.ERROR_CLASSES).sort(), DOCUMENTED.map(([, c]) => c).sort());
  });

  it("an unknown code is a VramguardError with that code", async () => {
    const { fetch } = fakeFetch(() => errorResponse(418, "teapot", "short and stout"));
    const error = await new Client({ fetch }).models().catch((e) => e);
    assert.equal(error.constructor, VramguardError);
    assert.equal(error.code, "teapot");
    assert.equal(error.status, 418);
    assert.equal(error.message, "short and stout");
  });

  it("an answer without the JSON error body is unexpected_response", async () => {
    const { fetch } = fakeFetch(() => new Response("<html>Bad Gateway</html>", { status: 502 }));
    const error = await new Client({ fetch }).models().catch((e) => e);
    assert.equal(error.constructor, vg.UnexpectedResponse);
    assert.equal(error.code, "unexpected_response");
    assert.equal(error.status, 502);
    assert.match(error.message, /HTTP 502.*Bad Gateway/);
    const { fetch: notJson } = fakeFetch(() => new Response("ok", { status: 200 }));
    const error2 = await new Client({ fetch: notJson }).models().catch((e) => e);
    assert.ok(error2 instanceof vg.UnexpectedResponse);
    assert.equal(error2.status, 200);
    const { fetch: list } = fakeFetch(() => jsonResponse([1, 2]));
    await assert.rejects(new Client({ fetch: list }).models(), vg.UnexpectedResponse);
  });

  it("nothing answers: NotRunning, not retried; a real closed port too", async () => {
    const cause = new TypeError("fetch failed", { cause: Object.assign(new Error("refused"), { code: "ECONNREFUSED" }) });
    const { fetch, calls } = fakeFetch(() => Promise.reject(cause));
    const error = await new Client({ fetch }).classify(JPEG).catch((e) => e);
    assert.ok(error instanceof vg.NotRunning);
    assert.equal(error.code, "not_running");
    assert.equal(error.status, null);
    assert.equal(error.cause, cause);
    assert.equal(calls.length, 1);
    const real = await new Client({ url: "http://127.0.0.1:1" }).models().catch((e) => e);
    assert.ok(real instanceof vg.NotRunning, String(real));
    assert.match(real.message, /127\.0\.0\.1:1.*is vramguard running/);
  });

  it("a connection that broke mid-call is ConnectionLost, tried again", async () => {
    const broke = new TypeError("fetch failed", { cause: Object.assign(new Error("socket"), { code: "UND_ERR_SOCKET" }) });
    const { fetch, calls } = fakeFetch((_, n) => (n === 0 ? Promise.reject(broke) : jsonResponse(CLASSIFIED)));
    assert.deepEqual(await new Client({ fetch }).classify(JPEG), CLASSIFIED);
    assert.equal(calls.length, 2);
    assert.ok(calls[1].at - calls[0].at >= 500, "backoff without Retry-After: 0.5 s first");
    const { fetch: always } = fakeFetch(() => Promise.reject(broke));
    const error = await new Client({ fetch: always, maxRetries: 0 }).classify(JPEG).catch((e) => e);
    assert.ok(error instanceof vg.ConnectionLost);
    assert.equal(error.code, "connection_lost");
    assert.equal(error.status, null);
  });

  it("a non-JSON 429 is still RateLimited (and retried)", async () => {
    const { fetch, calls } = fakeFetch((_, n) => (n === 0
      ? new Response("slow down", { status: 429, headers: { "retry-after": "0" } })
      : jsonResponse(CLASSIFIED)));
    assert.deepEqual(await new Client({ fetch }).classify(JPEG), CLASSIFIED);
    assert.equal(calls.length, 2);
    const { fetch: once } = fakeFetch(() => new Response("slow down", { status: 429 }));
    const error = await new Client({ fetch: once, maxRetries: 0 }).classify(JPEG).catch((e) => e);
    assert.ok(error instanceof vg.RateLimited);
    assert.equal(error.status, 429);
  });
});

describe("retries", () => {
  it("retries 429 and 503 after their Retry-After, then answers", async () => {
    const answers = [
      errorResponse(429, "rate_limited", "slow down", { "retry-after": "0.2" }),
      errorResponse(503, "overloaded", "busy", { "retry-after": "0.3" }),
      errorResponse(503, "insufficient_memory", "full", { "retry-after": "0.1" }),
      errorResponse(503, "deadline_exceeded", "late", { "retry-after": "0.1" }),
      errorResponse(503, "not_ready", "starting", { "retry-after": "0.1" }),
      jsonResponse(CLASSIFIED),
    ];
    const { fetch, calls } = fakeFetch((_, n) => answers[n]);
    const result = await new Client({ fetch }).classify(JPEG);
    assert.deepEqual(result, CLASSIFIED);
    assert.equal(calls.length, 6);
    const gaps = calls.slice(1).map((c, n) => c.at - calls[n].at);
    for (const [n, asked] of [200, 300, 100, 100, 100].entries()) {
      assert.ok(gaps[n] >= asked, `waited ${gaps[n]} ms, asked ${asked}`);
      // Jitter adds at most 25 % of max(wait, 0.5 s) (plus this loaded machine's slack).
      assert.ok(gaps[n] < asked + 0.25 * Math.max(asked, 500) + 300, `waited ${gaps[n]} ms`);
    }
  });

  it("a model being loaded: 503 loading is tried again after its Retry-After, within the deadline", async () => {
    // The server's contract: 503, {"error": {"code": "loading"}}, Retry-After in whole seconds.
    const loadingTwice = (_, n) => (n < 2
      ? { status: 503, headers: { "retry-after": "1" },
        body: { error: { code: "loading", message: "efficientnet_lite1 is being loaded, try again in 1 s" } } }
      : { body: CLASSIFIED });
    const server = await standIn(loadingTwice);
    try {
      const result = await new Client({ url: server.url, timeoutMs: 10000 })
        .classify(JPEG, { model: "efficientnet_lite1" });
      assert.deepEqual(result, CLASSIFIED);
      assert.equal(server.requests.length, 3);
      const gaps = server.requests.slice(1).map((r, n) => r.at - server.requests[n].at);
      for (const gap of gaps) assert.ok(gap >= 1000, `tried again after ${gap} ms, Retry-After was 1 s`);
    } finally {
      await server.close();
    }
    const again = await standIn(loadingTwice);
    try {
      // A wait that would pass the call's deadline: the Loading error at once.
      const error = await new Client({ url: again.url, timeoutMs: 800 }).classify(JPEG)
        .catch((e) => e);
      assert.ok(error instanceof vg.Loading && error instanceof vg.Unavailable, String(error));
      assert.deepEqual([error.code, error.status, error.retryAfter], ["loading", 503, 1]);
      assert.match(error.message, /being loaded/);
      assert.equal(again.requests.length, 1);
    } finally {
      await again.close();
    }
  });

  it("a 429 without Retry-After waits its RateLimit-Reset; without either, backs off", async () => {
    const answers = [
      errorResponse(429, "rate_limited", "slow", { "ratelimit-remaining": "0", "ratelimit-reset": "0.6" }),
      errorResponse(503, "overloaded", "busy"),
      jsonResponse(CLASSIFIED),
    ];
    const { fetch, calls } = fakeFetch((_, n) => answers[n]);
    await new Client({ fetch }).classify(JPEG);
    const gaps = calls.slice(1).map((c, n) => c.at - calls[n].at);
    assert.ok(gaps[0] >= 600, `waited ${gaps[0]} ms, reset was 600`);
    assert.ok(gaps[1] >= 1000, `second try's backoff: ${gaps[1]} ms, not 1 s`);
    assert.ok(gaps[1] < 1000 + 250 + 300, `second try's backoff: ${gaps[1]} ms`);
  });

  it("never retries other 4xx, 500, paused, or what is not vramguard's", async () => {
    const cases = [
      errorResponse(400, "bad_image"), errorResponse(400, "bad_request"),
      errorResponse(404, "not_found"), errorResponse(408, "request_timeout"),
      errorResponse(413, "payload_too_large"), errorResponse(415, "unsupported_media_type"),
      errorResponse(422, "image_too_complex"), errorResponse(500, "internal_error"),
      errorResponse(503, "paused", "paused", { "retry-after": "0" }),
      new Response("Service Unavailable", { status: 503, headers: { "retry-after": "0" } }),
    ];
    for (const answer of cases) {
      const { fetch, calls } = fakeFetch(() => answer.clone());
      await assert.rejects(new Client({ fetch }).classify(JPEG), VramguardError);
      assert.equal(calls.length, 1, `${answer.status} was retried`);
    }
  });

  it("throws the server's error at once when the wait asked for would pass the deadline", async () => {
    const { fetch, calls } = fakeFetch(() =>
      errorResponse(429, "rate_limited", "wait", { "retry-after": "5", "ratelimit-reset": "5" }));
    const started = performance.now();
    const error = await new Client({ fetch, timeoutMs: 2000 }).classify(JPEG).catch((e) => e);
    assert.ok(error instanceof vg.RateLimited);
    assert.equal(error.retryAfter, 5);
    assert.equal(calls.length, 1);
    assert.ok(performance.now() - started < 500, "it slept for nothing");
  });

  it("stops after maxRetries", async () => {
    const { fetch, calls } = fakeFetch(() =>
      errorResponse(503, "overloaded", "busy", { "retry-after": "0" }));
    await assert.rejects(new Client({ fetch, maxRetries: 2 }).classify(JPEG), vg.Overloaded);
    assert.equal(calls.length, 3);
    const { fetch: f0, calls: c0 } = fakeFetch(() =>
      errorResponse(503, "overloaded", "busy", { "retry-after": "0" }));
    await assert.rejects(new Client({ fetch: f0, maxRetries: 0 }).classify(JPEG), vg.Overloaded);
    assert.equal(c0.length, 1);
  });

  it("a 429 holds back the client's other image requests; reads are not held", async () => {
    const { fetch, calls } = fakeFetch((call, n) => (n === 0
      ? errorResponse(429, "rate_limited", "wait", { "retry-after": "0.4" })
      : jsonResponse(call.url.endsWith("/v1/models") ? { models: [] } : CLASSIFIED)));
    const client = new Client({ fetch });
    const first = client.classify(JPEG);
    await delay(50); // the 429 has come back
    const read = client.models();
    const second = await client.classify(JPEG);
    await Promise.all([first, read]);
    assert.deepEqual(second, CLASSIFIED);
    assert.equal(calls.length, 4);
    const images = calls.filter((c) => c.url.endsWith("/v1/classify"));
    for (const later of images.slice(1)) {
      assert.ok(later.at - images[0].at >= 400, `a request left ${later.at - images[0].at} ms after the 429`);
    }
    const models = calls.find((c) => c.url.endsWith("/v1/models"));
    assert.ok(models.at - images[0].at < 300, "GET /v1/models waited for the hold");
  });

  it("a hold longer than a call's deadline: Timeout, nothing sent", async () => {
    const { fetch, calls } = fakeFetch(() =>
      errorResponse(503, "overloaded", "busy", { "retry-after": "3" }));
    const client = new Client({ fetch });
    const cancel = new AbortController();
    const first = client.classify(JPEG, { signal: cancel.signal }).catch((e) => e); // holds ~3 s
    await delay(50);
    const error = await client.classify(JPEG, { timeoutMs: 500 }).catch((e) => e);
    assert.ok(error instanceof vg.Timeout, String(error));
    assert.equal(error.code, "timeout");
    assert.match(error.message, /asked this client to wait/);
    assert.equal(calls.length, 1);
    cancel.abort();
    assert.equal((await first).name, "AbortError");
  });

  it("the wait rules, by number", () => {
    const headers = (values) => new Headers(values);
    const serverNow = Date.parse("Mon, 30 Nov 2026 16:46:07 GMT");
    // Retry-After as an HTTP date counts from the answer's Date (the server's clock).
    assert.equal(retryAfterSeconds(headers({ "retry-after": "Mon, 30 Nov 2026 16:46:10 GMT",
      date: new Date(serverNow).toUTCString() })), 3);
    assert.equal(retryAfterSeconds(headers({ "retry-after": "Mon, 30 Nov 2026 16:46:00 GMT",
      date: new Date(serverNow).toUTCString() })), 0);
    assert.equal(retryAfterSeconds(headers({ "retry-after": " 2 " })), 2);
    assert.equal(retryAfterSeconds(headers({ "retry-after": "1.5" })), 1.5);
    assert.equal(retryAfterSeconds(headers({ "retry-after": "-1" })), null);
    assert.equal(retryAfterSeconds(headers({})), null);
    assert.equal(askedSeconds(429, headers({ "retry-after": "1", "ratelimit-reset": "3" })), 1);
    assert.equal(askedSeconds(429, headers({ "ratelimit-remaining": "0", "ratelimit-reset": "3" })), 3);
    assert.equal(askedSeconds(429, headers({ "ratelimit-remaining": "5", "ratelimit-reset": "3" })), null);
    assert.equal(askedSeconds(503, headers({ "ratelimit-remaining": "0", "ratelimit-reset": "3" })), null);
    const error = (code, retryAfter = null) => ({ code, retryAfter });
    const none = () => 0;
    const most = () => 0.999999;
    assert.equal(retryWaitMs(error("rate_limited", 2), 1, none), 2000);
    assert.ok(Math.abs(retryWaitMs(error("rate_limited", 2), 1, most) - 2500) < 1);
    assert.ok(Math.abs(retryWaitMs(error("overloaded", 0.1), 1, most) - 225) < 1);
    assert.deepEqual([1, 2, 3, 4, 5, 6, 7].map((t) => retryWaitMs(error("overloaded"), t, none)),
      [500, 1000, 2000, 4000, 8000, 8000, 8000]);
    assert.equal(retryWaitMs(error("connection_lost"), 1, none), 500);
    for (const code of ["paused", "bad_image", "not_found", "internal_error", "unexpected_response",
      "not_running", "timeout", "forbidden"]) {
      assert.equal(retryWaitMs(error(code, 1), 1, none), null, code);
    }
  });
});

describe("deadlines and cancelling", () => {
  it("no answer within timeoutMs: Timeout, the request aborted", async () => {
    const { fetch, calls } = fakeFetch(() => new Promise(() => {}));
    const started = performance.now();
    const error = await new Client({ fetch, timeoutMs: 150 }).models().catch((e) => e);
    assert.ok(error instanceof vg.Timeout, String(error));
    assert.equal(error.code, "timeout");
    assert.equal(error.status, null);
    assert.ok(calls[0].aborted);
    assert.ok(performance.now() - started >= 140);
    const perCall = await new Client({ fetch }).memory({ timeoutMs: 100 }).catch((e) => e);
    assert.ok(perCall instanceof vg.Timeout);
  });

  it("the caller's signal rejects with its reason, also during a wait", async () => {
    const { fetch } = fakeFetch(() => new Promise(() => {}));
    const controller = new AbortController();
    const pending = new Client({ fetch }).classify(JPEG, { signal: controller.signal });
    setTimeout(() => controller.abort(new Error("user cancelled")), 30);
    await assert.rejects(pending, /user cancelled/);
    const { fetch: slow } = fakeFetch(() =>
      errorResponse(503, "overloaded", "busy", { "retry-after": "10" }));
    const waiting = new AbortController();
    const started = performance.now();
    const during = new Client({ fetch: slow }).classify(JPEG, { signal: waiting.signal });
    setTimeout(() => waiting.abort(), 100);
    await assert.rejects(during, { name: "AbortError" });
    assert.ok(performance.now() - started < 2000);
    await assert.rejects(new Client({ fetch }).models({ signal: AbortSignal.abort() }),
      { name: "AbortError" });
  });
});

describe("classifyStream", () => {
  it("yields one item per input as each finishes; a bad image is an item, not the end", async () => {
    let inFlight = 0;
    let most = 0;
    const { fetch, calls } = fakeFetch(async (call) => {
      inFlight += 1;
      most = Math.max(most, inFlight);
      const body = new Uint8Array(call.init.body);
      await delay(10 + ((body[4] * 37) % 60));
      inFlight -= 1;
      return body[5] === 0xee ? errorResponse(400, "bad_image", "damaged") : jsonResponse({ ...CLASSIFIED, tag: body[4] });
    });
    const images = Array.from({ length: 12 }, (_, i) => new Uint8Array([0xff, 0xd8, 0xff, 0xe0, i, i === 5 ? 0xee : 0]));
    const progress = [];
    const items = [];
    for await (const item of new Client({ fetch }).classifyStream(images, {
      concurrency: 3, topK: 2, onProgress: (done, total) => progress.push({ done, total }),
    })) {
      items.push(item);
    }
    assert.equal(calls.length, 12);
    assert.ok(most <= 3 && most >= 2, `${most} in flight`);
    assert.deepEqual(items.map((i) => i.index).sort((a, b) => a - b), [...Array(12).keys()]);
    for (const item of items) {
      if (item.index === 5) {
        assert.equal(item.ok, false);
        assert.ok(item.error instanceof vg.BadImage);
      } else {
        assert.equal(item.ok, true);
        assert.equal(item.result.tag, item.index);
      }
    }
    assert.ok(calls.every((c) => c.url.endsWith("/v1/classify?top_k=2")));
    assert.deepEqual(progress.map((p) => p.done), [...Array(12).keys()].map((i) => i + 1));
    assert.ok(progress.every((p) => p.total === 12));
    assert.ok(items.every((i) => i.image === images[i.index]), "each item carries its input");
  });

  it("takes a lazy async source; an input that is not an image is that input's error", async () => {
    const { fetch } = fakeFetch(() => jsonResponse(CLASSIFIED));
    async function* source() {
      yield JPEG;
      yield "not bytes";
      yield new Blob([JPEG]);
    }
    const items = [];
    const progress = [];
    for await (const item of new Client({ fetch }).classifyStream(source(), { onProgress: (done, total) => progress.push({ done, total }) })) {
      items.push(item);
    }
    assert.deepEqual(items.map((i) => [i.index, i.ok]).sort(), [[0, true], [1, false], [2, true]]);
    assert.ok(items.find((i) => i.index === 1).error instanceof TypeError);
    assert.ok(progress.every((p) => p.total === undefined));
  });

  it("retries a rate-limited image inside the stream", async () => {
    const { fetch, calls } = fakeFetch((_, n) => (n === 1
      ? errorResponse(429, "rate_limited", "wait", { "retry-after": "0.2" })
      : jsonResponse(CLASSIFIED)));
    const items = [];
    for await (const item of new Client({ fetch }).classifyStream([JPEG, JPEG, JPEG], { concurrency: 1 })) {
      items.push(item);
    }
    assert.ok(items.every((i) => i.ok));
    assert.equal(calls.length, 4);
  });

  it("stopping early cancels the requests still running and closes the source", async () => {
    const { fetch, calls } = fakeFetch(async (call, n) => {
      if (n === 0) return jsonResponse(CLASSIFIED);
      return new Promise(() => {}); // never answers
    });
    let closed = false;
    function* source() {
      try {
        for (let i = 0; i < 100; i++) yield JPEG;
      } finally {
        closed = true;
      }
    }
    for await (const item of new Client({ fetch }).classifyStream(source(), { concurrency: 4 })) {
      assert.equal(item.index, 0);
      break;
    }
    assert.equal(calls.length, 4);
    assert.ok(calls.slice(1).every((c) => c.aborted), "requests left running");
    assert.ok(closed, "source not closed");
  });

  it("checks its arguments", async () => {
    const client = new Client({ fetch: fakeFetch(() => jsonResponse(CLASSIFIED)).fetch });
    await assert.rejects(client.classifyStream([JPEG], { concurrency: 0 }).next(), RangeError);
    await assert.rejects(client.classifyStream(42).next(), TypeError);
    const none = [];
    for await (const item of client.classifyStream([])) none.push(item);
    assert.deepEqual(none, []);
  });
});
