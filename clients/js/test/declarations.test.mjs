// index.d.ts against the module: every declared export exists with its kind, every
// export is declared, and the declared members of Client and the error classes exist.
// (No TypeScript compiler: a careful reading of the declarations file suffices here.)

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { it } from "node:test";

import * as vg from "../index.js";

const source = readFileSync(new URL("../index.d.ts", import.meta.url), "utf8")
  .replace(/\/\*[\s\S]*?\*\//g, "")
  .replace(/\/\/.*$/gm, "");

const declared = new Map(); // name -> kind
for (const [, kind, name] of source.matchAll(
  /^export\s+(?:declare\s+)?(class|function|const|interface|type)\s+([A-Za-z_$][\w$]*)/gm)) {
  declared.set(name, kind);
}
const hasDefault = /^export\s+default\s+Client\s*;/m.test(source);

function classBody(name) {
  const start = source.search(new RegExp(`^export declare class ${name}\\b`, "m"));
  assert.ok(start >= 0, `class ${name} not declared`);
  const open = source.indexOf("{", start);
  let depth = 0;
  for (let i = open; i < source.length; i++) {
    if (source[i] === "{") depth += 1;
    if (source[i] === "}" && --depth === 0) return source.slice(open + 1, i);
  }
  throw new Error(`class ${name} not closed`);
}

function members(body) {
  const names = new Set();
  for (const [, isStatic, name] of body.matchAll(
    /^\s*(static\s+)?(?:readonly\s+)?([A-Za-z_$][\w$]*)\s*[?(:<]/gm)) {
    if (name !== "constructor") names.add(`${isStatic ? "static " : ""}${name}`);
  }
  return names;
}

it("every value export of index.d.ts exists in index.js with its kind", () => {
  const values = [...declared].filter(([, kind]) => !["interface", "type"].includes(kind));
  assert.ok(values.length >= 25, `only ${values.length} value exports parsed`);
  for (const [name, kind] of values) {
    assert.ok(name in vg, `${name} is declared but not exported`);
    if (kind === "class" || kind === "function") {
      assert.equal(typeof vg[name], "function", `${name} should be a ${kind}`);
    }
    if (kind === "class") assert.ok(vg[name].prototype, `${name} is not a class`);
    if (kind === "const") assert.notEqual(typeof vg[name], "function");
  }
  assert.ok(hasDefault, "export default Client not declared");
  assert.equal(vg.default, vg.Client);
});

it("every export of index.js is declared", () => {
  for (const name of Object.keys(vg)) {
    if (name === "default") continue;
    assert.ok(declared.has(name), `${name} is exported but not declared in index.d.ts`);
  }
});

it("Client's declared members exist, and its methods are declared", () => {
  const declaredMembers = members(classBody("Client"));
  const client = new vg.Client({ fetch: () => Promise.reject(new Error("unused")) });
  for (const name of declaredMembers) {
    assert.ok(name in client, `Client.${name} is declared but missing`);
  }
  const methods = Object.getOwnPropertyNames(vg.Client.prototype).filter((n) => n !== "constructor");
  for (const name of methods) assert.ok(declaredMembers.has(name), `Client.${name} not declared`);
  for (const name of Object.keys(client)) assert.ok(declaredMembers.has(name), `Client.${name} not declared`);
  assert.equal(typeof client.classifyStream([])[Symbol.asyncIterator], "function");
});

it("the error classes are declared as VramguardError's subclasses, with their fields", () => {
  const errorClasses = [...declared].filter(([name, kind]) => kind === "class" && name !== "Client");
  for (const [name] of errorClasses) {
    const Class = vg[name];
    assert.ok(Class === vg.VramguardError || Class.prototype instanceof vg.VramguardError, name);
    if (name !== "VramguardError") {
      const parent = source.match(new RegExp(`export declare class ${name} extends (\\w+)`));
      assert.ok(parent, `${name} is declared without its base class`);
      assert.equal(Object.getPrototypeOf(Class), vg[parent[1]], `${name} does not extend ${parent[1]}`);
    }
    const error = new Class("message", { status: 1, retryAfter: 2 });
    for (const field of members(classBody("VramguardError"))) {
      const [isStatic, key] = field.startsWith("static ") ? [true, field.slice(7)] : [false, field];
      assert.ok(key in (isStatic ? Class : error), `${name}.${field} missing`);
    }
    for (const field of members(classBody(name))) {
      const [isStatic, key] = field.startsWith("static ") ? [true, field.slice(7)] : [false, field];
      assert.ok(key in (isStatic ? Class : error), `${name}.${field} missing`);
    }
  }
  // Every server code has its class declared.
  for (const Class of Object.values(vg.ERROR_CLASSES)) {
    assert.equal(declared.get(Class.name), "class", `${Class.name} not declared`);
  }
});

it("the declared result shapes name the server's fields (app/schemas.py)", () => {
  const schemas = readFileSync(new URL("../../../app/schemas.py", import.meta.url), "utf8");
  const pydantic = (model) => {
    const start = schemas.indexOf(`class ${model}(`);
    const end = schemas.indexOf("\nclass ", start + 1);
    return [...schemas.slice(start, end === -1 ? undefined : end)
      .matchAll(/^ {4}([a-z_]+):/gm)].map((m) => m[1]);
  };
  const iface = (name) => {
    const start = source.search(new RegExp(`^export interface ${name}\\b`, "m"));
    const body = source.slice(source.indexOf("{", start), source.indexOf("\n}", start));
    return new Set([...body.matchAll(/^ {2}([a-z_]+)\??:/gm)].map((m) => m[1]));
  };
  for (const [model, name] of [["ClassifyResponse", "ClassifyResult"], ["EmbedResponse", "EmbedResult"],
    ["ModelOut", "ModelInfo"], ["MemoryReport", "MemoryReport"], ["ModelMemory", "ModelMemory"],
    ["PredictionOut", "Prediction"]]) {
    const fields = pydantic(model);
    assert.ok(fields.length >= 3, `${model}: fields not found in app/schemas.py`);
    const mine = iface(name);
    for (const field of fields) assert.ok(mine.has(field), `${name} lacks ${field} (${model})`);
    for (const field of mine) assert.ok(fields.includes(field), `${name}.${field} is not in ${model}`);
  }
});
