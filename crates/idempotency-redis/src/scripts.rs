//! The Lua scripts: one per operation, each on exactly one key (the record's), so each runs
//! atomically and is safe on Redis Cluster. `begin` and `complete` also come in a batch form
//! ([`begin_many`], [`complete_many`]) that runs the same function once per key, in order, in one
//! script call: what a single server gets when callers are concurrent (see `Batcher` in the store).
//!
//! A record is a hash: `s` scope, `k` key (both readable for operators), `fp` fingerprint (hex),
//! `a` attempt, `c` created, `e` expires, `t` fencing token (hex), `st` state (`f` in flight,
//! `c` completed), `acq` acquired, `l` lease until (both left as they were once the record is
//! completed, and read by nothing: one command less), `done` completed at, `o` outcome. Times are
//! Unix milliseconds of the server's clock (`TIME`); the key's own expiry (`PEXPIREAT`) is `e`,
//! so expired records vanish by themselves. Every script also treats `e <= now` as absent, since
//! Redis only deletes a key strictly after its expiry time.
//!
//! Every script is safe to run twice (a reply lost on a dropped connection): a repeated `begin` or
//! `complete` with the same token is answered as the first one was, a repeated `extend` extends
//! again, a repeated `release` finds its token gone.

/// Shared prelude: the server's time in ms (`now`, and `now_s` formatted once), integer
/// formatting, and the foreign-value check. Each time is formatted once per script call or per
/// key and the string reused (an expiry is both a field and the key's `PEXPIREAT`): 7–12 %
/// less of Redis's time per key claimed and completed than formatting at each use
/// (`docs/BENCHMARKS.md`, "Times formatted once"). Lua numbers handed to `redis.call` as they
/// are cost more still: Redis formats each one itself.
const PRELUDE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function n(x) return string.format('%d', x) end
local now_s = n(now)
local function foreign(key)
  return redis.error_reply('IDEM_FOREIGN the record key ' .. key .. ' holds a hash that is not an idempotency record')
end
";

/// The function behind `begin`: the record key and the six arguments of [`begin`].
///
/// It asks `EXISTS` before it reads the record: a new key, the common case of a consumer or a
/// gateway, then costs `EXISTS`, `HSET` and `PEXPIREAT`, where reading first cost an 8-field
/// `HMGET` and the `EXISTS` that tells an absent key from a foreign hash (about 8 % less of
/// Redis's time for a new key's claim and completion; a key that exists pays one `EXISTS`
/// more; `docs/BENCHMARKS.md`, "A new key's claim without the read").
const BEGIN: &str = r"
local function begin_one(key, scope, k, fp, token, lease, retention)
lease, retention = tonumber(lease), tonumber(retention)
local r = {false}
if redis.call('EXISTS', key) == 1 then
  r = redis.call('HMGET', key, 'fp', 'a', 'e', 't', 'st', 'l', 'done', 'o')
  if r[1] == false then return foreign(key) end
  if tonumber(r[3]) <= now then
    redis.call('DEL', key)
    r[1] = false
  end
end
if r[1] == false then
  local lease_until = now + lease
  local expires = n(math.max(now + retention, lease_until))
  redis.call('HSET', key, 's', scope, 'k', k, 'fp', fp, 'a', '1', 'c', now_s,
    'e', expires, 't', token, 'st', 'f', 'acq', now_s, 'l', n(lease_until))
  redis.call('PEXPIREAT', key, expires)
  return {'acquired', 1, lease_until, now}
end
if r[1] ~= fp then return {'mismatch', now} end
if r[5] == 'c' then return {'replay', tonumber(r[2]), tonumber(r[7]), tonumber(r[3]), r[8], now} end
if r[4] == token then return {'acquired', tonumber(r[2]), tonumber(r[6]), now} end
local held = tonumber(r[6])
if now < held then return {'in_flight', tonumber(r[2]), held - now, now} end
local attempt = tonumber(r[2]) + 1
local lease_until = now + lease
local expires = n(math.max(tonumber(r[3]), now + retention, lease_until))
redis.call('HSET', key, 'a', n(attempt), 'e', expires, 't', token, 'acq', now_s, 'l', n(lease_until))
redis.call('PEXPIREAT', key, expires)
return {'acquired', attempt, lease_until, now}
end
";

/// The function behind `complete`: the record key and the three arguments of [`complete`].
const COMPLETE: &str = r"
local function complete_one(key, token, outcome, retention)
local r = redis.call('HMGET', key, 't', 'st', 'e')
if r[1] == false or tonumber(r[3]) <= now or r[1] ~= token then return {0} end
if r[2] == 'c' then return {1, tonumber(r[3])} end
local expires = now + tonumber(retention)
local expires_s = n(expires)
redis.call('HSET', key, 'st', 'c', 'o', outcome, 'done', now_s, 'e', expires_s)
if expires <= now then redis.call('DEL', key) else redis.call('PEXPIREAT', key, expires_s) end
return {1, expires}
end
";

/// The loop of a batch script: `one` for each key, its arguments `per_key` at a time from ARGV.
/// An error of one key (a foreign value at its key) is that key's reply, `{'error', text}`, not
/// the script's: the other keys of the batch are not its business.
fn many(one: &str, per_key: usize) -> String {
    let args: Vec<String> = (1..=per_key).map(|i| format!("ARGV[j + {i}]")).collect();
    format!(
        r"
local out = {{}}
for i = 1, #KEYS do
  local j = (i - 1) * {per_key}
  local ok, r = pcall({one}, KEYS[i], {args})
  if not ok or r.err then
    out[i] = {{'error', type(r) == 'table' and r.err or tostring(r)}}
  else
    out[i] = r
  end
end
return out
",
        args = args.join(", ")
    )
}

/// How many arguments `begin` takes per key.
pub(crate) const BEGIN_ARGS: usize = 6;
/// How many arguments `complete` takes per key.
pub(crate) const COMPLETE_ARGS: usize = 3;

/// `begin`: ARGV scope, key, fingerprint, token, lease ms, retention ms.
/// Returns `{'acquired', attempt, lease_until, now}`, `{'in_flight', attempt, retry_after_ms, now}`,
/// `{'replay', attempt, completed_at, expires_at, outcome, now}` or `{'mismatch', now}`.
pub(crate) fn begin() -> String {
    format!(
        "{PRELUDE}{BEGIN}return begin_one(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6])\n"
    )
}

/// `begin` for each of KEYS, with [`BEGIN_ARGS`] arguments per key in ARGV: an array of the
/// replies [`begin`] gives, or `{'error', text}` for a key that holds something else.
pub(crate) fn begin_many() -> String {
    format!("{PRELUDE}{BEGIN}{}", many("begin_one", BEGIN_ARGS))
}

/// `complete`: ARGV token, outcome, retention ms. Returns `{1, expires_at}` or `{0}`.
pub(crate) fn complete() -> String {
    format!("{PRELUDE}{COMPLETE}return complete_one(KEYS[1], ARGV[1], ARGV[2], ARGV[3])\n")
}

/// `complete` for each of KEYS, with [`COMPLETE_ARGS`] arguments per key in ARGV, as
/// [`begin_many`] does for `begin`.
pub(crate) fn complete_many() -> String {
    format!("{PRELUDE}{COMPLETE}{}", many("complete_one", COMPLETE_ARGS))
}

/// `release`: ARGV token, the token of no attempt. Returns 1 (released) or 0. The record stays,
/// held by no attempt and its lease ended: the next `begin` takes it over as attempt + 1.
pub(crate) fn release() -> String {
    format!(
        "{PRELUDE}{}",
        r"
local r = redis.call('HMGET', KEYS[1], 't', 'st', 'e')
if r[1] == false or tonumber(r[3]) <= now or r[1] ~= ARGV[1] or r[2] ~= 'f' then return 0 end
redis.call('HSET', KEYS[1], 't', ARGV[2], 'l', now_s)
return 1
"
    )
}

/// `forget`: ARGV token. Deletes a live record that holds the token (in flight, released or
/// completed); returns 1 (deleted) or 0.
pub(crate) fn forget() -> String {
    format!(
        "{PRELUDE}{}",
        r"
local r = redis.call('HMGET', KEYS[1], 't', 'e')
if r[1] == false or tonumber(r[2]) <= now or r[1] ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
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
  if redis.call('EXISTS', KEYS[1]) == 1 then return foreign(KEYS[1]) end
  return {}
end
if tonumber(r[6]) <= now then return {} end
local out = {now_s}
for i = 1, 12 do out[i + 1] = r[i] end
return out
"
    )
}
