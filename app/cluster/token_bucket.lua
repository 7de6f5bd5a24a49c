-- vramguard's token buckets shared by all replicas (app/cluster/redis_limiter.py): refill,
-- take and the waits of a client's bucket and, when given, its family's global bucket, in
-- one atomic call. One token is taken from every bucket or from none: a refusal costs
-- nothing (app/gates/rate_limit.py keeps the same rules in process).
--
-- KEYS[1]  the client's bucket, a hash {tokens, ts (ms)}
-- KEYS[2]  optional: the family's global bucket
-- ARGV     burst and tokens per second of KEYS[1], then those of KEYS[2] when given
-- Returns  {allowed (1 or 0), the client's whole tokens left (0 when refused),
--           ms until the client's bucket is full, ms until every bucket that blocks has a
--           token (0 when allowed)}: integers, rounded up, since Lua numbers come back
--           truncated.
--
-- Time is Redis's own (TIME), so the replicas' clocks never matter (Redis 5 or later
-- replicates a script's writes, not the script, so TIME is allowed). A missing key is a
-- full bucket: each key expires once its bucket would be full again, plus a second (at
-- most a day), so an idle client costs no memory.

local EPSILON = 1e-9 -- float refill arithmetic must not deny a token that is due
local MARGIN_MS = 1000
local MAX_TTL_MS = 86400000 -- a bucket idle for a day starts full (keeps PEXPIRE finite)

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + tonumber(time[2]) / 1000

local buckets = {}
local wait = 0
for i, key in ipairs(KEYS) do
  local burst = tonumber(ARGV[2 * i - 1])
  local per_ms = tonumber(ARGV[2 * i]) / 1000
  local tokens = burst
  local state = redis.call('HMGET', key, 'tokens', 'ts')
  if state[1] and state[2] then
    local elapsed = math.max(0, now - tonumber(state[2]))
    tokens = math.min(burst, tonumber(state[1]) + elapsed * per_ms)
  end
  if tokens < 1 - EPSILON then
    wait = math.max(wait, (1 - tokens) / per_ms)
  end
  buckets[i] = {key = key, burst = burst, per_ms = per_ms, tokens = tokens}
end

local client = buckets[1]
if wait > 0 then
  return {0, 0, math.ceil((client.burst - client.tokens) / client.per_ms), math.ceil(wait)}
end
for _, bucket in ipairs(buckets) do
  bucket.tokens = math.max(0, bucket.tokens - 1)
  redis.call('HSET', bucket.key, 'tokens', bucket.tokens, 'ts', now)
  local full_ms = math.ceil((bucket.burst - bucket.tokens) / bucket.per_ms)
  redis.call('PEXPIRE', bucket.key, math.min(full_ms + MARGIN_MS, MAX_TTL_MS))
end
return {1, math.floor(client.tokens),
        math.ceil((client.burst - client.tokens) / client.per_ms), 0}
