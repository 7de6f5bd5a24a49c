// Where the appliance listens, found in Node the way the Python client finds it
// (clients/python/vramguard_client/_discovery.py), without vramguard itself:
//
// 1. the instance file of a running vramguard (`run/instance-<port>.json` beside the admin
//    token file): its host, on the port its name gives, while the process that wrote it
//    runs (Node cannot probe the server's file lock, so it asks whether that process
//    lives; the server deletes the file when it stops);
// 2. the settings: VRAMGUARD_PORT / VRAMGUARD_HOST, else `port` / `host` in the config file
//    (VRAMGUARD_CONFIG, else `config.toml` in the per-user config folder);
// 3. the default, http://127.0.0.1:8765.
//
// A browser cannot read files: there `findServer()` answers the default (README.md says
// what a web page can do instead). Node's modules are imported only when it runs in Node,
// so that bundlers and browsers never need them.

export const DEFAULT_HOST = "127.0.0.1";
export const DEFAULT_PORT = 8765;
const APP_NAME = "vramguard";
const PREFIX = "VRAMGUARD_";
// Host settings reached at the loopback address of the family the server binds (IPv6
// exactly when the host has a colon): a server on ::1 is not on 127.0.0.1, where another
// program may listen (vramguard's own rule: app/host/address.py).
const TO_IPV4 = new Set(["127.0.0.1", "localhost", "0.0.0.0", ""]);
const TO_IPV6 = new Set(["::1", "::"]);

/** Node's fs, os and path; null where they cannot be imported (a bundle for a page). */
async function nodeModules() {
  if (typeof process === "undefined" || !process.versions?.node) return null;
  try {
    const [fs, os, path] = await Promise.all([
      import(/* webpackIgnore: true */ /* @vite-ignore */ "node:fs"),
      import(/* webpackIgnore: true */ /* @vite-ignore */ "node:os"),
      import(/* webpackIgnore: true */ /* @vite-ignore */ "node:path"),
    ]);
    return { fs, os, path };
  } catch {
    return null;
  }
}

/** vramguard's per-user config folder (what platformdirs' user_config_dir says). */
export function configFolder({ env, platform, home, path }) {
  if (platform === "win32") {
    return path.join(env.LOCALAPPDATA || path.join(home, "AppData", "Local"), APP_NAME);
  }
  if (platform === "darwin") return path.join(home, "Library", "Application Support", APP_NAME);
  const xdg = (env.XDG_CONFIG_HOME ?? "").trim();
  return path.join(xdg || path.join(home, ".config"), APP_NAME);
}

/** `host`, `port` and `token_file` of a TOML config file: the top-level `key = value`
 * lines with a string or a whole number (all a client needs; vramguard refuses tables). */
export function configValues(text) {
  const values = {};
  const line = /^[ \t]*(host|port|token_file)[ \t]*=[ \t]*("(?:[^"\\]|\\.)*"|'[^']*'|[+]?\d[\d_]*)[ \t]*(?:#.*)?$/gm;
  for (const [, key, raw] of text.matchAll(line)) {
    try {
      if (raw.startsWith('"')) values[key] = JSON.parse(raw);
      else if (raw.startsWith("'")) values[key] = raw.slice(1, -1);
      else values[key] = Number(raw.replaceAll("_", ""));
    } catch {
      // an escape JSON does not share with TOML: leave the key out
    }
  }
  return values;
}

function validPort(value) {
  const port = typeof value === "number" ? value : /^\s*\d+\s*$/.test(value ?? "") ? Number(value) : NaN;
  return Number.isInteger(port) && port > 0 && port < 65536 ? port : null;
}

/** The address a client on this computer uses for a server listening on `host`. */
export function urlFor(host, port) {
  const name = String(host).trim().replace(/^\[|\]$/g, "").toLowerCase();
  const reached = TO_IPV4.has(name) ? DEFAULT_HOST : TO_IPV6.has(name) ? "::1" : name;
  return reached.includes(":") ? `http://[${reached}]:${port}` : `http://${reached}:${port}`;
}

/** Whether process `pid` is alive (signal 0 tests that on every platform, Windows too). */
function alive(pid) {
  if (!Number.isInteger(pid) || pid <= 0) return false; // 0 or less would be a group
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false; // none (ESRCH), or another user's (EPERM): not this user's vramguard
  }
}

/** Port -> URL of each vramguard of this user described in `folder` and still running. */
function runningServers({ fs, path }, folder) {
  let info;
  try {
    info = fs.lstatSync(folder);
  } catch {
    return new Map();
  }
  // vramguard keeps the folder private: a link, or another user's folder, is not its.
  if (!info.isDirectory() || (process.platform !== "win32" && info.uid !== process.getuid())) {
    return new Map();
  }
  let names;
  try {
    names = fs.readdirSync(folder);
  } catch {
    return new Map();
  }
  const found = [];
  for (const name of names) {
    const port = validPort(/^instance-(\d+)\.json$/.exec(name)?.[1]);
    if (port === null) continue;
    let description;
    try {
      const fd = fs.openSync(path.join(folder, name), fs.constants.O_RDONLY | (fs.constants.O_NOFOLLOW ?? 0));
      try {
        description = JSON.parse(fs.readFileSync(fd, "utf8"));
      } finally {
        fs.closeSync(fd);
      }
    } catch {
      continue; // being written, unreadable, or a link
    }
    if (!alive(description?.pid)) continue; // a crashed server's leftovers
    let host = DEFAULT_HOST;
    try {
      const url = new URL(String(description.url));
      if (url.protocol === "http:" && url.hostname) host = url.hostname;
    } catch {
      // no URL: the loopback address, as the Python client does
    }
    found.push([port, urlFor(host, port)]);
  }
  return new Map(found.sort(([a], [b]) => a - b));
}

/**
 * Where the appliance is: `{ url, source }`, source being "instance" (a running
 * vramguard's instance file; the one on the configured port first), "config" (the
 * configured host and port) or "default". `env` stands for `process.env`.
 */
export async function findServer({ env } = {}) {
  const { url, source } = await locate({ env });
  return { url, source };
}

/** `findServer`'s answer and the admin token file beside it (`tokenFile`: null in a
 * browser), which the client's identity check reads. */
export async function locate({ env } = {}) {
  const modules = await nodeModules();
  if (modules === null) {
    return { url: urlFor(DEFAULT_HOST, DEFAULT_PORT), source: "default", tokenFile: null };
  }
  const { fs, os, path } = modules;
  const vars = env ?? process.env;
  const folder = configFolder({ env: vars, platform: process.platform, home: os.homedir(), path });
  let config = {};
  try {
    config = configValues(fs.readFileSync(vars[`${PREFIX}CONFIG`] || path.join(folder, "config.toml"), "utf8"));
  } catch {
    // none, or unreadable: a server would not start with an unreadable one
  }
  const setting = (name) => vars[PREFIX + name.toUpperCase()] || config[name];
  const tokenFile = setting("token_file") || path.join(folder, "admin-token");
  const host = setting("host");
  const port = validPort(setting("port"));
  const configured = port ?? DEFAULT_PORT;
  const running = runningServers(modules, path.join(path.dirname(String(tokenFile)), "run"));
  if (running.size) {
    return { url: running.get(configured) ?? running.values().next().value, source: "instance",
      tokenFile: String(tokenFile) };
  }
  return { url: urlFor(host || DEFAULT_HOST, configured),
    source: host || port ? "config" : "default", tokenFile: String(tokenFile) };
}
