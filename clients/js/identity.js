// The identity proof, in Node: before a Client that found the appliance itself (no url
// option) sends it an image, the server must prove it knows this user's admin token at
// the address and port the client reached. Another program holding the port (vramguard
// is down, or listens on ::1 while a relay holds 127.0.0.1) gets no image.
//
// The proof is vramguard's (app/host/token_file.py): HMAC-SHA256 keyed with the token
// over the nonce, one byte for the address's length, the address (an IP address's 4 or
// 16 bytes) and the port as two big-endian bytes. A browser cannot read the token file:
// there no proof is asked (README.md says so).

import { NotVramguard } from "./internal.js";

/** Node's crypto and fs; null where they cannot be imported (a page's bundle). */
export async function proofModules() {
  if (typeof process === "undefined" || !process.versions?.node) return null;
  try {
    const [crypto, fs] = await Promise.all([
      import(/* webpackIgnore: true */ /* @vite-ignore */ "node:crypto"),
      import(/* webpackIgnore: true */ /* @vite-ignore */ "node:fs"),
    ]);
    return { crypto, fs };
  } catch {
    return null;
  }
}

/** An IPv4 address's 4 bytes, or null. */
function ipv4Bytes(text) {
  const parts = text.split(".");
  if (parts.length !== 4 || !parts.every((p) => /^\d{1,3}$/.test(p) && Number(p) < 256)) {
    return null;
  }
  return parts.map(Number);
}

/** An IPv6 address's 16 bytes (as a URL's hostname writes it, without brackets), or null. */
function ipv6Bytes(text) {
  if (!text.includes(":")) return null;
  const dotted = /^(.*:)(\d+\.\d+\.\d+\.\d+)$/.exec(text); // ::ffff:a.b.c.d
  if (dotted) {
    const v4 = ipv4Bytes(dotted[2]);
    if (!v4) return null;
    const hex = (a, b) => ((a << 8) | b).toString(16);
    text = `${dotted[1]}${hex(v4[0], v4[1])}:${hex(v4[2], v4[3])}`;
  }
  const [head, tail = null, extra] = text.split("::");
  if (extra !== undefined) return null;
  const groups = (part) => (part ? part.split(":") : []);
  const left = groups(head);
  const right = tail === null ? [] : groups(tail);
  if (tail !== null && left.length + right.length > 7) return null;
  const words = [];
  for (const group of [...left, ...(tail === null ? [] : Array(8 - left.length - right.length).fill("0")), ...right]) {
    if (!/^[0-9a-f]{1,4}$/i.test(group)) return null;
    words.push(parseInt(group, 16));
  }
  if (words.length !== 8) return null;
  return words.flatMap((word) => [word >> 8, word & 0xff]);
}

/** The address as the proof binds it: 4 or 16 bytes for an IP address (an IPv4-mapped
 * IPv6 address as its IPv4 4), else the name's lower-case UTF-8. */
export function proofAddress(host) {
  const name = String(host).replace(/^\[|\]$/g, "");
  const v4 = ipv4Bytes(name);
  if (v4) return Uint8Array.from(v4);
  const v6 = ipv6Bytes(name);
  if (v6) {
    const mapped = v6.slice(0, 10).every((b) => b === 0) && v6[10] === 0xff && v6[11] === 0xff;
    return Uint8Array.from(mapped ? v6.slice(12) : v6);
  }
  return new TextEncoder().encode(name.toLowerCase());
}

/** What a vramguard listening at `host`:`port` answers to `nonce` (hex). */
export function identityProof({ crypto }, token, nonce, host, port) {
  const address = proofAddress(host);
  const message = Buffer.concat([nonce, Buffer.from([address.length]), Buffer.from(address),
    Buffer.from([port >> 8, port & 0xff])]);
  return crypto.createHmac("sha256", token).update(message).digest("hex");
}

/** The admin token from its file; NotVramguard (saying how to send images anyway) when
 * it cannot be read, or others may read it (vramguard itself refuses such a file). */
export function readToken({ fs }, tokenFile, url) {
  const anyway = ` Without it the program answering at ${url} cannot be checked to be ` +
    "your vramguard, so no image was sent to it. To send images there without the check, " +
    `name it: new Client({ url: "${url}" }).`;
  let token;
  try {
    const fd = fs.openSync(tokenFile, fs.constants.O_RDONLY);
    try {
      const mode = fs.fstatSync(fd).mode;
      if (process.platform !== "win32" && (mode & 0o077) !== 0) {
        throw new NotVramguard(`The admin token file ${tokenFile} can be read or changed ` +
          `by other users; make it private: chmod 600 ${tokenFile}.${anyway}`);
      }
      token = fs.readFileSync(fd, "utf8").trim();
    } finally {
      fs.closeSync(fd);
    }
  } catch (error) {
    if (error instanceof NotVramguard) throw error;
    throw new NotVramguard(`Cannot read the admin token file ${tokenFile} (${error.code ?? error.message}); ` +
      `vramguard writes it at its first start.${anyway}`);
  }
  if (!token) throw new NotVramguard(`The admin token file ${tokenFile} is empty.${anyway}`);
  return token;
}
