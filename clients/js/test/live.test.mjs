// The client against a real vramguard (`python -m app serve`). tests/live/test_client_js_live.py
// starts two and runs these with VRAMGUARD_URL (rate limit off) and VRAMGUARD_LIMITED_URL
// (one classify token, refilled every 2 s), and the first one's user folders and token
// file (so that a Client without url finds it); without them these tests skip.

import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { BadImage, Client, NotFound, RateLimited } from "../index.js";
import { chelsea, coffee, makePng } from "./helpers.mjs";

const URL_ = process.env.VRAMGUARD_URL;
const LIMITED = process.env.VRAMGUARD_LIMITED_URL;
const noServer = URL_ ? false : "VRAMGUARD_URL is not set (tests/live/test_client_js_live.py starts a server and sets it)";
const noLimited = LIMITED ? false : "VRAMGUARD_LIMITED_URL is not set (tests/live/test_client_js_live.py sets it)";

/** The real fetch, recording each request: when it left and when its answer came
 * (client clock), the status, the answer's Date and Retry-After; and the server's own
 * clock (`uptime_s` of GET /v1/stats, a read: it costs no classify token) just before
 * each image request leaves and just after its answer came, with the server's count of
 * 429 answers then. */
function recordingFetch(base) {
  const calls = [];
  const stats = async () => (await (await globalThis.fetch(`${base}/v1/stats`)).json());
  const fetch = async (url, init) => {
    const serverBefore = (await stats()).uptime_s;
    const call = { url, body: init.body, serverBefore, sent: performance.now() };
    calls.push(call);
    const response = await globalThis.fetch(url, init);
    call.answered = performance.now();
    const after = await stats();
    Object.assign(call, { status: response.status, serverAfter: after.uptime_s,
      rateLimited: after.rate_limited, date: Date.parse(response.headers.get("date")),
      retryAfter: response.headers.get("retry-after") });
    return response;
  };
  return { fetch, calls };
}

describe("against a real server", { skip: noServer }, () => {
  const client = new Client({ url: URL_ });

  it("classifies the espresso photo from a Buffer, a Uint8Array, an ArrayBuffer and a Blob", async () => {
    const bytes = coffee();
    const copy = new Uint8Array(bytes);
    for (const image of [bytes, copy, copy.buffer, new Blob([bytes])]) {
      const result = await client.classify(image, { topK: 3 });
      assert.equal(result.predictions[0].label, "espresso");
      assert.equal(result.predictions.length, 3);
      assert.equal(result.model, "efficientnet_lite0");
      assert.ok(result.predictions[0].score > 0.5);
    }
  });

  it("a Client without url finds the server on its moved port by its instance file", async () => {
    assert.ok(!URL_.endsWith(":8765"), `${URL_} is on the default port`);
    const found = new Client();
    const result = await found.classify(coffee(), { topK: 3 });
    assert.equal(result.predictions[0].label, "espresso");
    assert.deepEqual(found.location, { url: URL_, source: "instance" });
  });

  it("embeds: 1280 numbers of unit norm; the same photo twice has cosine 1", async () => {
    const first = await client.embed(coffee());
    assert.equal(first.dimensions, 1280);
    assert.equal(first.embedding.length, 1280);
    assert.ok(first.embedding.every((v) => typeof v === "number" && Number.isFinite(v)));
    const norm = Math.hypot(...first.embedding);
    assert.ok(Math.abs(norm - 1) < 1e-3, `norm ${norm}`);
    const cat = await client.embed(chelsea());
    const cosine = first.embedding.reduce((sum, v, i) => sum + v * cat.embedding[i], 0);
    assert.ok(cosine < 0.9, `espresso and cat: cosine ${cosine}`);
  });

  it("models() and memory()", async () => {
    const { models } = await client.models();
    const lite0 = models.find((m) => m.name === "efficientnet_lite0");
    assert.equal(lite0.state, "loaded");
    assert.equal(lite0.pinned, true);
    const memory = await client.memory();
    assert.ok(["ok", "high", "shedding"].includes(memory.state));
    assert.ok(memory.total_bytes > 0 && memory.budget_bytes > 0);
  });

  it("a model the server does not have is NotFound; a broken image BadImage", async () => {
    await assert.rejects(client.classify(coffee(), { model: "no_such_model" }),
      (e) => e instanceof NotFound && e.status === 404 && e.code === "not_found");
    await assert.rejects(client.classify(coffee().subarray(0, 3000)),
      (e) => e instanceof BadImage && e.status === 400 && /damaged|incomplete/.test(e.message));
  });

  it("classifyStream over 8 images, one broken: one result each, the broken one BadImage", async () => {
    const jpeg = coffee();
    const images = [jpeg, new Blob([chelsea()]), makePng(64, 1), jpeg.subarray(0, 2500),
      new Uint8Array(jpeg), makePng(40, 2).buffer.slice(0), chelsea(), new Blob([jpeg])];
    const broken = 3;
    const progress = [];
    const items = [];
    for await (const item of client.classifyStream(images, {
      concurrency: 3, topK: 1, onProgress: (done, total) => progress.push([done, total]),
    })) {
      items.push(item);
    }
    assert.deepEqual(items.map((i) => i.index).sort((a, b) => a - b), [...images.keys()]);
    for (const item of items) {
      if (item.index === broken) {
        assert.equal(item.ok, false);
        assert.ok(item.error instanceof BadImage, String(item.error));
      } else {
        assert.equal(item.ok, true, `image ${item.index}: ${item.error}`);
        assert.equal(item.result.predictions.length, 1);
      }
    }
    for (const index of [0, 4, 7]) {
      assert.equal(items.find((i) => i.index === index).result.predictions[0].label, "espresso");
    }
    assert.deepEqual(progress, images.map((_, n) => [n + 1, images.length]));
    assert.ok(items.every((i) => i.image === images[i.index]));
  });
});

/** Take the limited server's one classify token with a request that costs it nothing
 * else (a model it does not have: refused with 404 after the token was taken), so that
 * the next image request meets a 429 whatever the speed of this machine. */
async function drain() {
  await assert.rejects(new Client({ url: LIMITED }).classify(makePng(8), { model: "no_such_model" }),
    NotFound);
}

describe("against a rate-limited server (1 classify token, 0.5 a second)", { skip: noLimited }, () => {
  it("a 429 is retried after the server's Retry-After, by the server's clock too", async () => {
    const { fetch, calls } = recordingFetch(LIMITED);
    const client = new Client({ url: LIMITED, fetch });
    await drain();
    const result = await client.classify(coffee()); // no token left: 429, wait, then the answer
    assert.equal(result.predictions[0].label, "espresso");
    assert.deepEqual(calls.map((c) => c.status), [429, 200],
      "one 429, then one retry that the server accepted (a retry sent too early gets 429 again)");
    const [refused, accepted] = calls;
    assert.equal(accepted.rateLimited, refused.rateLimited, "the server counted another 429");
    const asked = Number(refused.retryAfter);
    assert.ok(asked >= 1, `Retry-After ${refused.retryAfter}`);
    // Client clock: the retry left at least Retry-After seconds after the 429 came back.
    const waited = accepted.sent - refused.answered;
    assert.ok(waited >= asked * 1000, `retried after ${waited} ms; the server asked ${asked} s`);
    assert.ok(waited < asked * 1000 * 1.1 + 100 + 1500, `waited ${waited} ms: too long`);
    // Server clock: its uptime read after the 429 had been sent and before the retry
    // left are at least Retry-After apart, so the retry reached it no sooner than asked.
    const serverWait = accepted.serverBefore - refused.serverAfter;
    assert.ok(serverWait >= asked, `by the server's clock the retry came ${serverWait} s after the 429`);
    // Its Date headers agree, to their resolution: whole seconds, refreshed by uvicorn
    // once a second (so up to a second old).
    assert.ok(accepted.date - refused.date >= (asked - 1) * 1000,
      `server dates ${new Date(refused.date).toISOString()} -> ${new Date(accepted.date).toISOString()}`);
  });

  it("within a deadline shorter than Retry-After: RateLimited at once, no retry", async () => {
    const { fetch, calls } = recordingFetch(LIMITED);
    await drain();
    const started = performance.now();
    const error = await new Client({ url: LIMITED, fetch, timeoutMs: 900 })
      .classify(coffee()).catch((e) => e);
    assert.ok(error instanceof RateLimited, String(error));
    assert.equal(error.status, 429);
    assert.ok(error.retryAfter >= 1);
    assert.equal(error.limit, 1);
    assert.deepEqual(calls.map((c) => c.status), [429]);
    assert.ok(performance.now() - started < 900);
  });

  it("classifyStream through the rate limit: every image answered, no retry early", async () => {
    const { fetch, calls } = recordingFetch(LIMITED);
    const client = new Client({ url: LIMITED, fetch });
    const images = [coffee(), chelsea(), makePng(32, 3)];
    await drain();
    const items = [];
    for await (const item of client.classifyStream(images, { concurrency: 3 })) items.push(item);
    assert.equal(items.length, 3);
    assert.ok(items.every((i) => i.ok), items.map((i) => String(i.error)).join("; "));
    // One token every 2 s: each image met at least one 429, and each of its retries left
    // no sooner than the Retry-After of the 429 before it.
    for (const image of images) {
      const attempts = calls.filter((c) => c.body === image);
      assert.equal(attempts.at(-1).status, 200);
      assert.ok(attempts.length >= 2, `${attempts.length} attempts`);
      for (const [n, refused] of attempts.slice(0, -1).entries()) {
        assert.equal(refused.status, 429);
        const next = attempts[n + 1];
        assert.ok(next.sent - refused.answered >= Number(refused.retryAfter) * 1000,
          `a retry left ${next.sent - refused.answered} ms after a 429 asking ${refused.retryAfter} s`);
        assert.ok(next.serverBefore - refused.serverAfter >= Number(refused.retryAfter));
      }
    }
  });
});
