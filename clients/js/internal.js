// Errors, content sniffing and the retry rules of the vramguard client (index.js
// re-exports what is public; the tests use the rest directly).

/** Any failure of a call: `code` is the server's stable error code (or the client's own:
 * `not_running`, `not_vramguard`, `connection_lost`, `timeout`, `unexpected_response`), `status` the
 * HTTP status (null when no answer came), `retryAfter` the seconds the server asked to
 * wait (null when it asked nothing). */
export class VramguardError extends Error {
  static code = "error";
  static status = null;

  constructor(message, { code, status, retryAfter = null, cause } = {}) {
    super(message, cause === undefined ? undefined : { cause });
    this.name = new.target.name;
    this.code = code ?? new.target.code;
    this.status = status ?? new.target.status;
    this.retryAfter = retryAfter;
  }
}

// One class per code of app/errors.py (and the 429 of app/gates/rate_limit.py), as in
// the Python client (clients/python/vramguard_client/_errors.py).
export class BadImage extends VramguardError {
  static code = "bad_image";
  static status = 400;
}
export class BadRequest extends VramguardError {
  static code = "bad_request";
  static status = 400;
}
export class Unauthorized extends VramguardError {
  static code = "unauthorized";
  static status = 401;
}
export class Forbidden extends VramguardError {
  static code = "forbidden";
  static status = 403;
}
export class NotFound extends VramguardError {
  static code = "not_found";
  static status = 404;
}
export class MethodNotAllowed extends VramguardError {
  static code = "method_not_allowed";
  static status = 405;
}
export class RequestTimeout extends VramguardError {
  static code = "request_timeout";
  static status = 408;
}
export class Conflict extends VramguardError {
  static code = "conflict";
  static status = 409;
}
export class PayloadTooLarge extends VramguardError {
  static code = "payload_too_large";
  static status = 413;
}
export class ImageTooLarge extends VramguardError {
  static code = "image_too_large";
  static status = 413;
}
export class UnsupportedMediaType extends VramguardError {
  static code = "unsupported_media_type";
  static status = 415;
}
export class ImageTooComplex extends VramguardError {
  static code = "image_too_complex";
  static status = 422;
}
export class RateLimited extends VramguardError {
  static code = "rate_limited";
  static status = 429;

  constructor(message, options = {}) {
    super(message, options);
    /** RateLimit-Limit: the client's burst. */
    this.limit = options.limit ?? null;
    /** RateLimit-Reset: seconds until the client's bucket is full again. */
    this.reset = options.reset ?? null;
  }
}
export class ClientClosed extends VramguardError {
  static code = "client_closed";
  static status = 499;
}
export class InternalError extends VramguardError {
  static code = "internal_error";
  static status = 500;
}
/** Base of the 503 answers: the appliance cannot take this image now. */
export class Unavailable extends VramguardError {
  static code = "unavailable";
  static status = 503;
}
export class Overloaded extends Unavailable {
  static code = "overloaded";
}
export class DeadlineExceeded extends Unavailable {
  static code = "deadline_exceeded";
}
export class NotReady extends Unavailable {
  static code = "not_ready";
}
/** The model asked for is being loaded; `retryAfter` says when to come back. */
export class Loading extends Unavailable {
  static code = "loading";
}
export class Paused extends Unavailable {
  static code = "paused";
}
export class InsufficientMemory extends Unavailable {
  static code = "insufficient_memory";
}
// The client's own (status null: no answer, or not vramguard's).
/** Nothing answers at the appliance's address. */
export class NotRunning extends VramguardError {
  static code = "not_running";
}
/** The connection broke before the answer came (tried again within the deadline). */
export class ConnectionLost extends VramguardError {
  static code = "connection_lost";
}
/** The call's deadline (`timeoutMs`, retries included) ran out. */
export class Timeout extends VramguardError {
  static code = "timeout";
}
/** The appliance this client found cannot prove it is this user's vramguard (another
 * program holds its port): nothing but the challenge was sent to it. */
export class NotVramguard extends VramguardError {
  static code = "not_vramguard";
}
/** An answer that is not vramguard's JSON. */
export class UnexpectedResponse extends VramguardError {
  static code = "unexpected_response";
}

/** The class for each server error code. */
export const ERROR_CLASSES = Object.freeze(Object.fromEntries([
  BadImage, BadRequest, Unauthorized, Forbidden, NotFound, MethodNotAllowed, RequestTimeout,
  Conflict, PayloadTooLarge, ImageTooLarge, UnsupportedMediaType, ImageTooComplex,
  RateLimited, ClientClosed, InternalError, Overloaded, DeadlineExceeded, NotReady, Loading,
  Paused, InsufficientMemory,
].map((cls) => [cls.code, cls])));

/** Codes worth another try; every other error (other 4xx, paused, ...) is thrown at once.
 * (replica_lost: a cluster replica died with the request; another one answers it.) */
export const RETRIED = new Set(["rate_limited", "overloaded", "deadline_exceeded", "not_ready",
  "loading", "insufficient_memory", "connection_lost", "replica_lost"]);
/** Codes that hold back every image request of the client, not only the refused one: the
 * server refused this client, or is refusing everyone. */
export const PACED = new Set(["rate_limited", "overloaded", "not_ready"]);
export const JITTER = 0.25; // a wait grows by up to this share (never shrinks)
export const BACKOFF_MS = 500; // without Retry-After: 0.5, 1, 2, 4, 8 s
export const BACKOFF_MAX_MS = 8000;

const startsWith = (bytes, prefix, offset = 0) =>
  bytes.length >= offset + prefix.length && prefix.every((b, i) => bytes[offset + i] === b);
const ascii = (text) => [...text].map((c) => c.charCodeAt(0));

/** The image type from its first bytes (JPEG, PNG, WebP, GIF, BMP, TIFF), else
 * application/octet-stream (which the server accepts too). */
export function sniffContentType(bytes) {
  if (startsWith(bytes, [0xff, 0xd8, 0xff])) return "image/jpeg";
  if (startsWith(bytes, [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a])) return "image/png";
  if (startsWith(bytes, ascii("RIFF")) && startsWith(bytes, ascii("WEBP"), 8)) return "image/webp";
  if (startsWith(bytes, ascii("GIF87a")) || startsWith(bytes, ascii("GIF89a"))) return "image/gif";
  if (startsWith(bytes, ascii("BM"))) return "image/bmp";
  if (startsWith(bytes, [0x49, 0x49, 0x2a, 0x00]) || startsWith(bytes, [0x4d, 0x4d, 0x00, 0x2a])) {
    return "image/tiff";
  }
  return "application/octet-stream";
}

/** Retry-After in seconds (delta-seconds, or an HTTP date measured against the answer's
 * own Date, the server's clock), or null without a valid one. */
export function retryAfterSeconds(headers) {
  const value = headers.get("retry-after")?.trim();
  if (!value) return null;
  if (/^\d+(\.\d+)?$/.test(value)) return Number(value);
  if (!/[A-Za-z]{3}/.test(value)) return null; // "-1" and the like: Date.parse takes them
  const when = Date.parse(value);
  if (Number.isNaN(when)) return null;
  const served = Date.parse(headers.get("date") ?? "");
  return Math.max(0, (when - (Number.isNaN(served) ? Date.now() : served)) / 1000);
}

function headerNumber(headers, name) {
  const value = headers.get(name)?.trim();
  return value && /^\d+(\.\d+)?$/.test(value) ? Number(value) : null;
}

/** Seconds the server asked to wait: Retry-After, else for a 429 with no token left
 * (RateLimit-Remaining 0) its RateLimit-Reset; null when it asked nothing. */
export function askedSeconds(status, headers) {
  const seconds = retryAfterSeconds(headers);
  if (seconds !== null || status !== 429) return seconds;
  return headers.get("ratelimit-remaining")?.trim() === "0"
    ? headerNumber(headers, "ratelimit-reset") : null;
}

/** The wait before try number `tries + 1` after `error`, in ms (jittered: up to 25 % more,
 * never less than asked), or null when it is not worth another try. */
export function retryWaitMs(error, tries, random = Math.random) {
  if (!RETRIED.has(error.code)) return null;
  const base = error.retryAfter !== null
    ? error.retryAfter * 1000
    : Math.min(BACKOFF_MAX_MS, BACKOFF_MS * 2 ** (tries - 1));
  return base + random() * JITTER * Math.max(base, BACKOFF_MS);
}

/** The typed error for a failed answer: the class of its JSON body's code. */
export function errorFromResponse(status, headers, text) {
  let code;
  let message;
  try {
    const error = JSON.parse(text)?.error;
    if (typeof error?.code === "string") {
      code = error.code;
      message = typeof error.message === "string" ? error.message : code;
    }
  } catch {
    // not JSON: a proxy's page, say
  }
  const retryAfter = askedSeconds(status, headers);
  const limits = { limit: headerNumber(headers, "ratelimit-limit"),
    reset: headerNumber(headers, "ratelimit-reset") };
  if (code === undefined) {
    const snippet = String(text ?? "").slice(0, 200).trim();
    if (status === 429) {
      return new RateLimited(snippet || "Too many requests", { status, retryAfter, ...limits });
    }
    return new UnexpectedResponse(`HTTP ${status} without a vramguard error body` +
      (snippet ? `: ${snippet}` : ""), { status, retryAfter });
  }
  const Class = ERROR_CLASSES[code] ?? VramguardError;
  return new Class(message, { code, status, retryAfter, ...(Class === RateLimited ? limits : {}) });
}

// Node's fetch (undici) names the socket error of a connection that broke; a browser's
// says nothing, and then the failure counts as nothing answering.
const BROKEN = new Set(["ECONNRESET", "EPIPE", "ECONNABORTED", "UND_ERR_SOCKET",
  "UND_ERR_CLOSED"]);

/** The client's error for a fetch that failed without an answer. */
export function transportError(cause, url) {
  const code = cause?.cause?.code ?? cause?.code;
  if (BROKEN.has(code)) {
    return new ConnectionLost(`The connection to ${url} broke: ${code}`, { cause });
  }
  return new NotRunning(`Nothing answers at ${url}: is vramguard running? ` +
    `(${code ?? cause?.message ?? cause})`, { cause });
}
