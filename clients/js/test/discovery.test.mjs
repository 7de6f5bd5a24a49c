// findServer() and a Client without url, in Node: the instance file of a running
// vramguard, then the settings, then the default; a server that moved is followed. The
// "running" vramguards here are real HTTP stand-ins described by instance files the way
// app/host/instance.py writes them (a live server: live.test.mjs).

import assert from "node:assert/strict";
import { spawnSync } from "node:child_process";
import { mkdirSync, readFileSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { afterEach, beforeEach, describe, it } from "node:test";

import { Client, findServer, NotRunning } from "../index.js";
import { configValues, urlFor } from "../discovery.js";
import { coffee, isolateUserFolders, provingStandIn, standIn, writeToken } from "./helpers.mjs";

let config; // this test's per-user config folder

/** What a vramguard on `port` writes about itself (beside `tokenFile`, default the config
 * folder's admin-token); `pid` is the process that holds the lock. */
function describeServer(port, { pid = process.pid, url = `http://127.0.0.1:${port}`,
  tokenFile = join(config, "admin-token") } = {}) {
  const folder = join(tokenFile, "..", "run");
  mkdirSync(folder, { recursive: true, mode: 0o700 });
  writeFileSync(join(folder, `instance-${port}.json`), JSON.stringify(
    { pid, port, url, started: 1, launcher_pid: null, launcher_started: null }));
  writeFileSync(join(folder, `instance-${port}.lock`), "");
}

/** The PID of a process that has ended (a crashed server's). */
function deadPid() {
  const child = spawnSync(process.execPath, ["-e", ""]);
  assert.equal(child.status, 0);
  return child.pid;
}

beforeEach(() => {
  config = isolateUserFolders();
});
afterEach(() => {
  rmSync(join(config, ".."), { recursive: true, force: true });
});

describe("findServer", () => {
  it("without anything: the default address", async () => {
    assert.deepEqual(await findServer(), { url: "http://127.0.0.1:8765", source: "default" });
  });

  it("the config file, then the environment, then VRAMGUARD_CONFIG's file", async () => {
    mkdirSync(config, { recursive: true });
    writeFileSync(join(config, "config.toml"),
      'log_level = "debug"\nport = 9123   # moved\r\nhost = "0.0.0.0"\ncors_origins = [\n  "http://localhost:3000",\n]\n');
    assert.deepEqual(await findServer(), { url: "http://127.0.0.1:9123", source: "config" });
    process.env.VRAMGUARD_PORT = "9200";
    assert.equal((await findServer()).url, "http://127.0.0.1:9200");
    delete process.env.VRAMGUARD_PORT;
    const other = join(config, "other.toml");
    writeFileSync(other, "port = 9_300\nhost = '::1'\n");
    assert.equal((await findServer({ env: { ...process.env, VRAMGUARD_CONFIG: other } })).url,
      "http://[::1]:9300");
    writeFileSync(other, 'host = "vision.example.com"\nport = 70000\n'); // not a port: the default
    assert.deepEqual(await findServer({ env: { ...process.env, VRAMGUARD_CONFIG: other } }),
      { url: "http://vision.example.com:8765", source: "config" });
  });

  it("reads TOML's strings and whole numbers, and leaves the rest alone", () => {
    assert.deepEqual(configValues('port = 8780\ntoken_file = "C:\\\\Users\\\\me\\\\tok"\n' +
      "host = 'a.b' # note\n[table]\nmodels = [\"x\"]\nport_x = 1\n"),
    { port: 8780, token_file: "C:\\Users\\me\\tok", host: "a.b" });
    assert.equal(urlFor("[fe80::1]", 2), "http://[fe80::1]:2");
    assert.equal(urlFor("localhost", 3), "http://127.0.0.1:3");
  });

  it("reaches a server on the loopback address of the family it listens on", () => {
    // The table tests/unit/host/test_address.py holds vramguard and the Python client to.
    const table = JSON.parse(readFileSync(new URL("../../../tests/data/reached_hosts.json",
      import.meta.url), "utf8"));
    for (const [host, url] of Object.entries(table)) assert.equal(urlFor(host, 8765), url, host);
  });

  it("a running vramguard's instance file comes first, the configured port's first of all", async () => {
    process.env.VRAMGUARD_PORT = "9001";
    describeServer(9400, { pid: deadPid() }); // a crashed server's leftovers
    assert.equal((await findServer()).source, "config");
    describeServer(9500);
    assert.deepEqual(await findServer(), { url: "http://127.0.0.1:9500", source: "instance" });
    describeServer(9001);
    assert.equal((await findServer()).url, "http://127.0.0.1:9001");
    describeServer(9001, { url: "http://192.168.1.5:9001" }); // bound to that address
    assert.equal((await findServer()).url, "http://192.168.1.5:9001");
    describeServer(9001, { url: "http://0.0.0.0:9001" });
    assert.equal((await findServer()).url, "http://127.0.0.1:9001");
  });

  it("looks beside the token file that VRAMGUARD_TOKEN_FILE or the config names", async () => {
    const tokens = join(config, "..", "elsewhere", "admin-token");
    describeServer(9600, { tokenFile: tokens });
    assert.equal((await findServer()).source, "default");
    process.env.VRAMGUARD_TOKEN_FILE = tokens;
    assert.equal((await findServer()).url, "http://127.0.0.1:9600");
    delete process.env.VRAMGUARD_TOKEN_FILE;
    mkdirSync(config, { recursive: true });
    writeFileSync(join(config, "config.toml"), `token_file = ${JSON.stringify(tokens)}\n`);
    assert.equal((await findServer()).url, "http://127.0.0.1:9600");
  });

  it("a link in place of the instance folder or file is not vramguard's", { skip: process.platform === "win32" }, async () => {
    const planted = join(config, "..", "planted");
    describeServer(9700, { tokenFile: join(planted, "admin-token") });
    mkdirSync(config, { recursive: true });
    symlinkSync(join(planted, "run"), join(config, "run"));
    assert.equal((await findServer()).source, "default");
    rmSync(join(config, "run"));
    mkdirSync(join(config, "run"), { mode: 0o700 });
    symlinkSync(join(planted, "run", "instance-9700.json"), join(config, "run", "instance-9700.json"));
    assert.equal((await findServer()).source, "default");
  });
});

describe("a Client without url", () => {
  it("finds a vramguard moved to another port by its instance file, and classifies there", async () => {
    mkdirSync(config, { recursive: true });
    const server = await provingStandIn(writeToken(join(config, "admin-token")));
    try {
      assert.notEqual(server.port, 8765);
      describeServer(server.port);
      const client = new Client();
      assert.equal(client.location.source, "default"); // found at the first call
      const result = await client.classify(coffee(), { topK: 3 });
      assert.equal(result.predictions[0].label, "espresso");
      assert.deepEqual(client.location, { url: server.url, source: "instance" });
      assert.deepEqual(server.requests.map((r) => r.url), ["/v1/identity", "/v1/classify?top_k=3"]);
    } finally {
      await server.close();
    }
  });

  it("follows the appliance once per call when it restarts on another port", async () => {
    const first = await standIn(() => ({ body: { models: [] } }));
    describeServer(first.port);
    const client = new Client({ timeoutMs: 5000 });
    await client.models();
    assert.equal(client.url, first.url);
    await first.close();
    rmSync(join(config, "run", `instance-${first.port}.json`));
    const moved = await standIn(() => ({ body: { models: ["moved"] } }));
    try {
      describeServer(moved.port);
      assert.deepEqual(await client.models(), { models: ["moved"] });
      assert.deepEqual(client.location, { url: moved.url, source: "instance" });
    } finally {
      await moved.close();
    }
    rmSync(join(config, "run"), { recursive: true });
    process.env.VRAMGUARD_PORT = String(first.port); // closed: nothing answers anywhere
    const error = await client.models().catch((e) => e);
    assert.ok(error instanceof NotRunning, String(error));
    const given = new Client({ url: moved.url }); // a given url is never left
    assert.deepEqual(given.location, { url: moved.url, source: "argument" });
    describeServer(first.port);
    await assert.rejects(given.models(), NotRunning);
    assert.equal(given.url, moved.url);
  });
});
