// A Client that finds the appliance itself (no url) sends images only to a server that
// proves it knows this user's admin token at the address and port reached (issue 26):
// another program holding the port, or relaying from the other loopback family, gets
// the challenge and nothing else. Real HTTP servers on the loopback, no vramguard.

import assert from "node:assert/strict";
import { mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { afterEach, beforeEach, describe, it } from "node:test";

import { Client, NotVramguard } from "../index.js";
import { proofAddress, identityProof } from "../identity.js";
import { coffee, isolateUserFolders, provingStandIn, writeToken } from "./helpers.mjs";
import * as crypto from "node:crypto";

const config = isolateUserFolders();
const tokenFile = join(config, "admin-token");

function describeServer(url, port) {
  const folder = join(config, "run");
  mkdirSync(folder, { recursive: true, mode: 0o700 });
  writeFileSync(join(folder, `instance-${port}.json`), JSON.stringify(
    { pid: process.pid, port, url, started: 1, launcher_pid: null, launcher_started: null }));
  writeFileSync(join(folder, `instance-${port}.lock`), "");
}

describe("the identity proof before the first image", () => {
  beforeEach(() => mkdirSync(config, { recursive: true }));
  afterEach(() => rmSync(config, { recursive: true, force: true }));

  it("is vramguard's own proof (the vectors app/host/token_file.py made)", () => {
    const vectors = JSON.parse(readFileSync(new URL("../../../tests/data/identity_proofs.json",
      import.meta.url), "utf8"));
    for (const { token, nonce, host, port, proof } of vectors) {
      assert.equal(identityProof({ crypto }, token, Buffer.from(nonce, "hex"), host, port),
        proof, host);
    }
    assert.equal(proofAddress("::ffff:127.0.0.1").length, 4); // a dual-stack socket's view
    assert.equal(proofAddress("[::1]").length, 16);
  });

  it("goes to a found vramguard once, then images follow", async () => {
    const server = await provingStandIn(writeToken(tokenFile));
    try {
      describeServer(server.url, server.port);
      const client = new Client();
      await client.classify(coffee());
      await client.classify(coffee());
      assert.deepEqual(server.requests.map((r) => r.url),
        ["/v1/identity", "/v1/classify", "/v1/classify"]);
      assert.ok(server.requests.every((r) => r.authorization === undefined)); // no token sent
    } finally {
      await server.close();
    }
  });

  it("a program that cannot prove it gets no image", async () => {
    writeToken(tokenFile);
    const squatter = await provingStandIn("another user's token");
    try {
      describeServer(squatter.url, squatter.port);
      const error = await new Client().classify(coffee()).catch((e) => e);
      assert.ok(error instanceof NotVramguard, String(error));
      assert.match(error.message, /no image was sent/);
      assert.deepEqual(squatter.requests.map((r) => r.url), ["/v1/identity"]);
    } finally {
      await squatter.close();
    }
  });

  it("a relay on 127.0.0.1 for a vramguard on ::1 gets no image", async () => {
    // What the relay hands back is the real server's answer: bound to ::1, not to the
    // 127.0.0.1 this client reached.
    const relay = await provingStandIn(writeToken(tokenFile), { proves: "::1" });
    try {
      describeServer(relay.url, relay.port);
      await assert.rejects(new Client().classify(coffee()), NotVramguard);
      assert.deepEqual(relay.requests.map((r) => r.url), ["/v1/identity"]);
    } finally {
      await relay.close();
    }
  });

  it("without a readable token file nothing is sent, and the message says how to", async () => {
    const server = await provingStandIn("s3cret-token");
    try {
      describeServer(server.url, server.port);
      const error = await new Client().classify(coffee()).catch((e) => e);
      assert.ok(error instanceof NotVramguard, String(error));
      assert.match(error.message, /name it: new Client\(\{ url: "http:\/\/127\.0\.0\.1:\d+" \}\)/);
      assert.deepEqual(server.requests.map((r) => r.url), ["/v1/identity"]);
    } finally {
      await server.close();
    }
  });

  it("a url the app names is trusted as given: no challenge", async () => {
    const server = await provingStandIn("s3cret-token");
    try {
      await new Client({ url: server.url }).classify(coffee());
      assert.deepEqual(server.requests.map((r) => r.url), ["/v1/classify"]);
    } finally {
      await server.close();
    }
  });
});
