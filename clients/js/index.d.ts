// Type declarations of the vramguard JavaScript client (index.js). Hand-written; keep them
// in step with index.js and internal.js (test/declarations.test.mjs checks the exports).

/** What `classify` and `embed` accept. A Node `Buffer` and a `File` are accepted too (a
 * Buffer is a Uint8Array, a File a Blob); any other ArrayBuffer view is read as bytes. */
export type ImageInput = Blob | ArrayBuffer | ArrayBufferView;

/** What `classifyStream` takes: any list of images, also produced lazily. */
export type ImageSource = Iterable<ImageInput> | AsyncIterable<ImageInput>;

/** The `fetch` the client calls (the global one by default). */
export type FetchLike = (input: string, init: RequestInit) => Promise<Response>;

export interface ClientOptions {
  /** The appliance's address. Without it the client finds it as `findServer()` does (in
   * Node; in a browser `"http://127.0.0.1:8765"`), and follows it once per call when
   * nothing answers where it was. */
  url?: string;
  /** Deadline of one call in milliseconds, waits and retries included. Default 60000. */
  timeoutMs?: number;
  /** The `fetch` to use. Default `globalThis.fetch`. */
  fetch?: FetchLike;
  /** Sent as `X-Client-Id` (1–64 of `A-Z a-z 0-9 . _ -`): a rate-limit bucket of its
   * own; otherwise all local programs share one. */
  clientId?: string;
  /** Most retries of one call. Default 10. */
  maxRetries?: number;
}

export interface CallOptions {
  /** Abort the call: it rejects with the signal's reason. */
  signal?: AbortSignal;
  /** This call's deadline in milliseconds instead of the client's `timeoutMs`. */
  timeoutMs?: number;
}

export interface ModelOptions extends CallOptions {
  /** A model name `models()` lists; the server's default (`--model`) when omitted. A model
   * not loaded yet is loaded first, and the call waits for it. */
  model?: string;
  /** Seconds the model stays loaded after each use, at least; default: the server's
   * `keep_alive_s`. It can only lengthen the model's stay, up to the server's
   * `max_keep_alive_s` (1 hour by default): a shorter stay, 0 (unload when done) or -1
   * (for ever) needs the admin token, which this client never sends, so the server
   * serves the request, leaves the stay as it was, and says so in the answer's
   * `X-Vramguard-Keep-Alive` header. To free the memory, unload the model from the
   * tray or with the admin token. */
  keepAlive?: number;
}

export interface ClassifyOptions extends ModelOptions {
  /** How many classes to return, 1–1000. Default 5 (the server's). A multilabel model
   * ignores it: it answers every label above `threshold`. */
  topK?: number;
  /** A multilabel model only (other models ignore it): the score, between 0 and 1 (both
   * excluded), a label needs to be in the answer. Default: the model's own. */
  threshold?: number;
}

export type EmbedOptions = ModelOptions;

export interface Prediction {
  label: string;
  index: number;
  /** Probability between 0 and 1. */
  score: number;
}

export interface ClassifyResult {
  model: string;
  /** The most likely classes, best first; for a multilabel model the same as `labels`. */
  predictions: Prediction[];
  /** A multilabel model only (a model that names every label that fits the picture, not
   * one class): every label scored above `threshold`, best first, maybe none. Null for
   * any other model. */
  labels: Prediction[] | null;
  /** A multilabel model only: the score a label needed (the request's `threshold`, else
   * the model's own). Null for any other model. */
  threshold: number | null;
  /** Images computed together with this one; null for an answer from the result cache. */
  batch_size: number | null;
  cached: boolean;
  /** `read_and_decode`, `queue_and_inference`, `total`. */
  timing_ms: Record<string, number>;
}

export interface EmbedResult {
  model: string;
  /** Length of `embedding` (1280 for EfficientNet-Lite0). */
  dimensions: number;
  /** L2-normalised: the dot product of two is their cosine similarity. */
  embedding: number[];
  /** Images computed together with this one; null for an answer from the result cache. */
  batch_size: number | null;
  cached: boolean;
  timing_ms: Record<string, number>;
}

export interface BatchTiming {
  batch_size: number;
  latency_ms: number;
  images_per_second: number;
}

export interface ModelInfo {
  name: string;
  /** `"loaded"`, `"loading"` or `"available"`. */
  state: string;
  family: string;
  input_size: number;
  installed: boolean;
  note: string;
  /** `"classify"`, `"multilabel"` (every label above a threshold) or `"embed"` (image
   * features only: `embed()`; `classify()` gets a `BadRequest`). */
  task: string;
  /** Where it comes from: `"efficientnet_lite"`, `"torchvision"`, or an own model's
   * format (`"timm"`, `"timm-hf"`, `"transformers"`, `"torchscript"`, `"export"`,
   * `"onnx"`). */
  format: string;
  /** How many labels it answers with (0 for an `"embed"` model). */
  labels: number;
  pinned: boolean;
  keep_alive_s: number | null;
  expires_in_s: number | null;
  device: string | null;
  weights_file: string | null;
  weights_version: string | null;
  weights_bytes: number | null;
  fixed_bytes: number | null;
  bytes_per_sample: number | null;
  batch_size: number | null;
  max_batch_size: number | null;
  images_per_second: number | null;
  batch_fit: { a_ms: number; b_ms: number; observations: number } | null;
  profile_reused: boolean | null;
  /** False while batch sizes beyond 1 are still measured in the background (then it runs
   * one image per batch). */
  profile_complete: boolean | null;
  warmup_seconds: number | null;
  warmup: BatchTiming[];
}

export interface ModelsResult {
  models: ModelInfo[];
}

export interface ModelMemory {
  name: string;
  weights_bytes: number;
  batch_peak_bytes: number;
  batch_size: number;
  pinned: boolean;
  /** `"classify"`, `"multilabel"` or `"embed"`, as in `ModelInfo`. */
  task: string;
  /** Where it comes from, as in `ModelInfo`. */
  format: string;
  /** How many labels it answers with (0 for an `"embed"` model). */
  labels: number;
  /** One of your models (from the models folder), not a built-in one. */
  own: boolean;
}

/** `GET /v1/memory` (see the README's API section for each field). */
/** Another program using the GPU, as NVML lists it. */
export interface GpuProgram {
  pid: number;
  name: string;
  /** null where the driver does not say (often under Windows' WDDM). */
  used_bytes: number | null;
}

/** Another vramguard on the same GPU: with it, each plans for an equal share. */
export interface SharingServer {
  pid: number;
  port: number;
  /** null where the driver does not say (often under Windows' WDDM). */
  used_bytes: number | null;
}

export interface MemoryReport {
  device: string;
  source: string;
  nvml: boolean;
  total_bytes: number;
  used_bytes: number;
  free_bytes: number;
  allocated_bytes: number;
  reserved_bytes: number;
  peak_allocated_bytes: number;
  peak_reserved_bytes: number;
  others_bytes: number;
  other_programs: GpuProgram[];
  weights_bytes: number;
  overhead_bytes: number;
  configured_budget_bytes: number;
  budget_bytes: number;
  low_watermark_bytes: number;
  high_watermark_bytes: number;
  usage_bytes: number;
  /** `"ok"`, `"high"` or `"shedding"`. */
  state: string;
  fixed_bytes: number;
  bytes_per_sample: number;
  profiled_bytes_per_sample: number;
  profile_points: { batch_size: number; peak_bytes: number }[];
  max_batch_now: number;
  cpu_memory_cap_bytes: number | null;
  process_used_bytes: number | null;
  oom_events: number;
  oom_recoveries: number;
  oom_failures: number;
  state_changes: number;
  idle_releases: number;
  cache_empties: number;
  fragmentation_releases: number;
  leak_suspected: boolean;
  leak_growth_bytes: number;
  idle_baselines_bytes: number[];
  large_allocations: number;
  gpu_utilization_ratio?: number | null;
  cpu_instead_of_gpu?: string | null;
  sharing_with: SharingServer[];
  sharing_problem?: string | null;
  models: ModelMemory[];
}

/** One image's outcome in `classifyStream`: `index` is its position in the input,
 * `image` the input itself. */
export type StreamItem =
  | { index: number; image: ImageInput; ok: true; result: ClassifyResult }
  | { index: number; image: ImageInput; ok: false; error: VramguardError | Error };

export interface StreamOptions extends ClassifyOptions {
  /** Requests in flight at most. Default 4. */
  concurrency?: number;
  /** Called as each image finishes, before it is yielded: images finished so far
   * (failed ones included), and how many there are (undefined when the input has no
   * `length`). An exception it throws ends the stream. */
  onProgress?: (done: number, total: number | undefined) => void;
}

export declare const DEFAULT_URL: string;

/** Where the appliance is, and how that was found: `"argument"` (the `url` option),
 * `"instance"` (a running vramguard's instance file), `"config"` (`VRAMGUARD_PORT` /
 * `VRAMGUARD_HOST` or the config file) or `"default"`. */
export interface ServerLocation {
  url: string;
  source: "argument" | "instance" | "config" | "default";
}

/** Find the running appliance (Node only; a browser gets the default): its instance
 * file, else the configured host and port, else `http://127.0.0.1:8765`, by the Python
 * client's rules. `env` stands for `process.env`. */
export declare function findServer(options?: { env?: Record<string, string | undefined> }): Promise<ServerLocation>;

export declare class Client {
  constructor(options?: ClientOptions);
  /** The appliance's address: `location.url`. */
  readonly url: string;
  /** Where the appliance is: the `url` option, else what the first call found (until
   * then the default). */
  readonly location: ServerLocation;
  readonly timeoutMs: number;
  readonly clientId: string | undefined;
  readonly maxRetries: number;
  /** `POST /v1/classify`: the image's most likely classes. */
  classify(image: ImageInput, options?: ClassifyOptions): Promise<ClassifyResult>;
  /** `POST /v1/embed`: the image's features (L2-normalised). */
  embed(image: ImageInput, options?: EmbedOptions): Promise<EmbedResult>;
  /** `GET /v1/models`: every model this install can serve. */
  models(options?: CallOptions): Promise<ModelsResult>;
  /** `GET /v1/memory`: device memory, budget, watermarks and guard state. */
  memory(options?: CallOptions): Promise<MemoryReport>;
  /** Classify many images, at most `concurrency` at a time; yields one item per input as
   * each finishes (in finishing order). A failed image never ends the stream. Breaking
   * out of the loop cancels the requests still running. */
  classifyStream(images: ImageSource, options?: StreamOptions): AsyncGenerator<StreamItem, void, undefined>;
}
export default Client;

export interface ErrorOptions {
  code?: string;
  status?: number | null;
  retryAfter?: number | null;
  cause?: unknown;
}

/** Every failure of a call. */
export declare class VramguardError extends Error {
  /** The code a class stands for (`"error"` on the base class). */
  static readonly code: string;
  /** The HTTP status a class stands for (null for the client's own errors). */
  static readonly status: number | null;
  constructor(message: string, options?: ErrorOptions);
  /** The server's error code, e.g. `"bad_image"`; or the client's own: `"not_running"`,
   * `"connection_lost"`, `"timeout"`, `"unexpected_response"`. */
  readonly code: string;
  /** The HTTP status; null when no answer came. */
  readonly status: number | null;
  /** Seconds the server asked to wait (Retry-After; for a 429 without it,
   * RateLimit-Reset), or null when it asked nothing. */
  readonly retryAfter: number | null;
}

/** 400: empty body, not an image, damaged or truncated file. */
export declare class BadImage extends VramguardError {}
/** 400: e.g. an invalid `topK` or `threshold`, or `classify` with an `"embed"` model. */
export declare class BadRequest extends VramguardError {}
/** 401: an admin endpoint without the right token. */
export declare class Unauthorized extends VramguardError {}
/** 403: a Host or web page Origin the server does not accept. */
export declare class Forbidden extends VramguardError {}
/** 404: unknown path, or a `model` that `models()` does not list. */
export declare class NotFound extends VramguardError {}
/** 405. */
export declare class MethodNotAllowed extends VramguardError {}
/** 408: the upload stalled. */
export declare class RequestTimeout extends VramguardError {}
/** 409: e.g. unloading a model with images in progress. */
export declare class Conflict extends VramguardError {}
/** 413: the upload is over the server's `max_body_bytes`. */
export declare class PayloadTooLarge extends VramguardError {}
/** 413: too many pixels, or too much memory to open. */
export declare class ImageTooLarge extends VramguardError {}
/** 415: not an image type the server accepts (SVG, icons, …). */
export declare class UnsupportedMediaType extends VramguardError {}
/** 422: a file built to take far too long to open. */
export declare class ImageTooComplex extends VramguardError {}
/** 429: this client sends faster than its rate (retried). */
export declare class RateLimited extends VramguardError {
  constructor(message: string, options?: ErrorOptions & { limit?: number | null; reset?: number | null });
  /** RateLimit-Limit: the client's burst. */
  readonly limit: number | null;
  /** RateLimit-Reset: seconds until the client's bucket is full again. */
  readonly reset: number | null;
}
/** 499: the client hung up before its answer. */
export declare class ClientClosed extends VramguardError {}
/** 500. */
export declare class InternalError extends VramguardError {}
/** Base of the 503 answers: the appliance cannot take this image now. */
export declare class Unavailable extends VramguardError {}
/** 503: the queue or the uploads are full (retried). */
export declare class Overloaded extends Unavailable {}
/** 503: not answered within the server's `request_timeout_s` (retried). */
export declare class DeadlineExceeded extends Unavailable {}
/** 503: still starting, or the model failed (retried). */
export declare class NotReady extends Unavailable {}
/** 503: the model asked for is being loaded (retried after its `Retry-After`). */
export declare class Loading extends Unavailable {}
/** 503: an admin paused the appliance (not retried). */
export declare class Paused extends Unavailable {}
/** 503: this image, or the model asked for, does not fit in GPU memory now (retried). */
export declare class InsufficientMemory extends Unavailable {}
/** Nothing answers at the appliance's address (the fetch error is `cause`). Not retried. */
export declare class NotRunning extends VramguardError {}
/** In Node, a Client without `url` found an appliance that cannot prove it is this
 * user's vramguard (it does not know the admin token at the address and port reached):
 * no image was sent to it. Not retried. */
export declare class NotVramguard extends VramguardError {}
/** The connection broke before the answer came (retried within the deadline). */
export declare class ConnectionLost extends VramguardError {}
/** The call's deadline (`timeoutMs`, waits and retries included) ran out. */
export declare class Timeout extends VramguardError {}
/** An answer that is not vramguard's JSON (`status` is its HTTP status). */
export declare class UnexpectedResponse extends VramguardError {}

/** The error class for each server error code. */
export declare const ERROR_CLASSES: Readonly<Record<string, typeof VramguardError>>;

/** The image type from its first bytes: `image/jpeg`, `image/png`, `image/webp`,
 * `image/gif`, `image/bmp`, `image/tiff`, else `application/octet-stream`. */
export declare function sniffContentType(bytes: Uint8Array): string;
