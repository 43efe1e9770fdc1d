//! The Lua scripts: one per operation, each on exactly one key (the record's), so each runs
//! atomically and is safe on Redis Cluster.
//!
//! A record is a hash: `s` scope, `k` key (both readable for operators), `fp` fingerprint (hex),
//! `a` attempt, `c` created, `e` expires, `t` fencing token (hex), `st` state (`f` in flight,
//! `c` completed), `acq` acquired, `l` lease until, `done` completed at, `o` outcome. Times are
//! Unix milliseconds of the server's clock (`TIME`); the key's own expiry (`PEXPIREAT`) is `e`,
//! so expired records vanish by themselves. Every script also treats `e <= now` as absent, since
//! Redis only deletes a key strictly after its expiry time.
//!
//! Every script is safe to run twice (a reply lost on a dropped connection): a repeated `begin` or
//! `complete` with the same token is answered as the first one was, a repeated `extend` extends
//! again, a repeated `release` finds its token gone.

/// Shared prelude: the server's time in ms, integer formatting, and the foreign-value check.
const PRELUDE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function n(x) return string.format('%d', x) end
local function foreign()
  return redis.error_reply('IDEM_FOREIGN the record key ' .. KEYS[1] .. ' holds a hash that is not an idempotency record')
end
";

/// `begin`: ARGV scope, key, fingerprint, token, lease ms, retention ms.
/// Returns `{'acquired', attempt, lease_until, now}`, `{'in_flight', attempt, retry_after_ms, now}`,
/// `{'replay', attempt, completed_at, expires_at, outcome, now}` or `{'mismatch', now}`.
pub(crate) fn begin() -> String {
    format!(
        "{PRELUDE}{}",
        r"
local lease, retention = tonumber(ARGV[5]), tonumber(ARGV[6])
local r = redis.call('HMGET', KEYS[1], 'fp', 'a', 'e', 't', 'st', 'l', 'done', 'o')
if r[1] == false and redis.call('EXISTS', KEYS[1]) == 1 then return foreign() end
if r[1] == false or tonumber(r[3]) <= now then
  local lease_until = now + lease
  local expires = math.max(now + retention, lease_until)
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 's', ARGV[1], 'k', ARGV[2], 'fp', ARGV[3], 'a', '1', 'c', n(now),
    'e', n(expires), 't', ARGV[4], 'st', 'f', 'acq', n(now), 'l', n(lease_until))
  redis.call('PEXPIREAT', KEYS[1], n(expires))
  return {'acquired', 1, lease_until, now}
end
if r[1] ~= ARGV[3] then return {'mismatch', now} end
if r[5] == 'c' then return {'replay', tonumber(r[2]), tonumber(r[7]), tonumber(r[3]), r[8], now} end
if r[4] == ARGV[4] then return {'acquired', tonumber(r[2]), tonumber(r[6]), now} end
local held = tonumber(r[6])
if now < held then return {'in_flight', tonumber(r[2]), held - now, now} end
local attempt = tonumber(r[2]) + 1
local lease_until = now + lease
local expires = math.max(tonumber(r[3]), now + retention, lease_until)
redis.call('HSET', KEYS[1], 'a', n(attempt), 'e', n(expires), 't', ARGV[4], 'acq', n(now), 'l', n(lease_until))
redis.call('PEXPIREAT', KEYS[1], n(expires))
return {'acquired', attempt, lease_until, now}
"
    )
}

/// `complete`: ARGV token, outcome, retention ms. Returns `{1, expires_at}` or `{0}`.
pub(crate) fn complete() -> String {
    format!(
        "{PRELUDE}{}",
        r"
local r = redis.call('HMGET', KEYS[1], 't', 'st', 'e')
if r[1] == false or tonumber(r[3]) <= now or r[1] ~= ARGV[1] then return {0} end
if r[2] == 'c' then return {1, tonumber(r[3])} end
local expires = now + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'st', 'c', 'o', ARGV[2], 'done', n(now), 'e', n(expires))
redis.call('HDEL', KEYS[1], 'acq', 'l')
if expires <= now then redis.call('DEL', KEYS[1]) else redis.call('PEXPIREAT', KEYS[1], n(expires)) end
return {1, expires}
"
    )
}

/// `release`: ARGV token, the token of no attempt. Returns 1 (released) or 0. The record stays,
/// held by no attempt and its lease ended: the next `begin` takes it over as attempt + 1.
pub(crate) fn release() -> String {
    format!(
        "{PRELUDE}{}",
        r"
local r = redis.call('HMGET', KEYS[1], 't', 'st', 'e')
if r[1] == false or tonumber(r[3]) <= now or r[1] ~= ARGV[1] or r[2] ~= 'f' then return 0 end
redis.call('HSET', KEYS[1], 't', ARGV[2], 'l', n(now))
return 1
"
    )
}

/// `extend`: ARGV token, lease ms. Returns `{1, lease_until}` or `{0}`.
pub(crate) fn extend() -> String {
    format!(
        "{PRELUDE}{}",
        r"
local r = redis.call('HMGET', KEYS[1], 't', 'st', 'e')
if r[1] == false or tonumber(r[3]) <= now or r[1] ~= ARGV[1] or r[2] ~= 'f' then return {0} end
local lease_until = now + tonumber(ARGV[2])
local expires = math.max(tonumber(r[3]), lease_until)
redis.call('HSET', KEYS[1], 'l', n(lease_until), 'e', n(expires))
redis.call('PEXPIREAT', KEYS[1], n(expires))
return {1, lease_until}
"
    )
}

/// `get`: no ARGV. Returns `{}` for an absent or expired record, else `{now, s, k, fp, a, c, e,
/// t, st, acq, l, done, o}` (missing fields as `false`, i.e. nil).
pub(crate) fn get() -> String {
    format!(
        "{PRELUDE}{}",
        r"
local r = redis.call('HMGET', KEYS[1], 's', 'k', 'fp', 'a', 'c', 'e', 't', 'st', 'acq', 'l', 'done', 'o')
if r[3] == false then
  if redis.call('EXISTS', KEYS[1]) == 1 then return foreign() end
  return {}
end
if tonumber(r[6]) <= now then return {} end
local out = {n(now)}
for i = 1, 12 do out[i + 1] = r[i] end
return out
"
    )
}
