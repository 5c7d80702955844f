-- lib.lua: helpers shared by every gpulock operation. Not an operation of its own: the loader
-- (gpulock/_scripts.py) builds each operation from this file and the operation's file, as a
-- function of the gpulock library and as a script (see bind() below), so every operation sees
-- the same KEYS layout and helpers.
--
-- KEYS (the same eight, in this order, for every script; one hash tag per pool):
--   1 gpulock:{pool}:cfg      hash  capacity, used, fence, epoch, qvt, max_waiters, created_ms,
--                                   grants, reaped_leases, reaped_waiters; the device sampler's
--                                   report (external.lua): external, external_until, overuse,
--                                   dev_sampler, dev_sampler_until
--   2 gpulock:{pool}:leases   zset  lease id -> server expiry (ms)
--   3 gpulock:{pool}:holders  hash  lease id -> "amount|token|acquired_ms|ttl_ms|ticket|meta"
--   4 gpulock:{pool}:queue    zset  ticket -> queue score (lowest first): its arrival time in
--                                   virtual microseconds minus priority x AGING_US (see
--                                   queue_score below)
--   5 gpulock:{pool}:waiters  hash  ticket -> "amount|ttl_ms|enqueued_ms|lease_id|channel|priority|meta"
--   6 gpulock:{pool}:wexp     zset  ticket -> waiter expiry (ms)
--   7 gpulock:{pool}:tickets  hash  ticket -> lease id of the grant made to that ticket
--   8 gpulock:{pool}:events   prefix of the pub/sub channels: a grant made to a queued ticket is
--                             published on "<events>:<channel>", the channel id its process gave
--                             to acquire (one channel per waiting process, so a hand-off wakes
--                             only the process that waits for it), as
--                             "g <now_ms>\n<ticket> <lease_id> <token> <expires_ms> <amount>\n..."
-- Units: amounts in bytes (integers), times in milliseconds of the Redis server clock.
-- Numbers are always formatted with fmt() before they reach redis.call: Lua would print a
-- double such as a fencing token as "1.7e+15" and lose digits.

-- The pool's keys, bound by bind() at the start of every call: the loader (gpulock/_scripts.py)
-- runs each operation either as a script (EVALSHA: this file, "bind(KEYS)", the operation's
-- file) or as a function of one library loaded once (FCALL, Redis >= 7 and Valkey: this file,
-- then each operation wrapped as a function of (KEYS, ARGV) that starts with bind(KEYS)).
local K_CFG, K_LEASES, K_HOLDERS, K_QUEUE, K_WAITERS, K_WEXP, K_TICKETS, K_EVENTS
local POOL_KEYS
local function bind(keys)
  POOL_KEYS = keys
  K_CFG, K_LEASES, K_HOLDERS, K_QUEUE, K_WAITERS, K_WEXP, K_TICKETS, K_EVENTS =
    keys[1], keys[2], keys[3], keys[4], keys[5], keys[6], keys[7], keys[8]
end

local MAX_AMOUNT = 9007199254740991      -- 2^53 - 1: the largest integer a Lua double holds exactly
local MIN_TTL_MS, MAX_TTL_MS = 100, 86400000
local MAX_META = 512
-- Priorities (docs/SEMANTICS.md, "Priorities"): an integer in [PRIO_MIN, PRIO_MAX], higher goes
-- first; a waiter's effective priority rises by one level per AGING_US microseconds waited.
local PRIO_MIN, PRIO_MAX, AGING_US = -100, 100, 1000000

local function fmt(n) return string.format('%d', n) end

local function bad(msg) return redis.error_reply('GPULOCK_BADARG ' .. msg) end

local function show(v)
  if v == nil then return '<missing>' end
  v = tostring(v)
  if #v > 64 then v = string.sub(v, 1, 64) .. '...' end
  return "'" .. v .. "'"
end

-- Parse a decimal integer argument; returns the number, or nil and an error reply.
local function int_arg(v, name, lo, hi)
  if type(v) ~= 'string' or not string.match(v, '^%d+$') or #v > 16 then
    return nil, bad(name .. ' must be a decimal integer, got ' .. show(v))
  end
  local n = tonumber(v)
  if n < lo or n > hi then
    return nil, bad(name .. ' must be in [' .. fmt(lo) .. ', ' .. fmt(hi) .. '], got ' .. v)
  end
  return n
end

local function id_arg(v, name)
  if type(v) ~= 'string' or #v < 1 or #v > 128 or not string.match(v, '^[%w%-_.:]+$') then
    return nil, bad(name .. ' must be 1-128 characters of [A-Za-z0-9._:-], got ' .. show(v))
  end
  return v
end

-- A priority: a decimal integer, optionally signed, in [PRIO_MIN, PRIO_MAX].
local function prio_arg(v)
  if type(v) ~= 'string' or not string.match(v, '^%-?%d+$') or #v > 8 then
    return nil, bad('priority must be a decimal integer, got ' .. show(v))
  end
  local n = tonumber(v)
  if n < PRIO_MIN or n > PRIO_MAX then
    return nil, bad('priority must be in [' .. fmt(PRIO_MIN) .. ', ' .. fmt(PRIO_MAX) .. '], got ' .. v)
  end
  return n
end

local function lease_id_arg(v)
  if type(v) ~= 'string' or not string.match(v, '^%x+$') or #v ~= 32 then
    return nil, bad('lease id must be 32 hex digits, got ' .. show(v))
  end
  return v
end

local function meta_arg(v)
  if type(v) ~= 'string' or #v > MAX_META then
    return nil, bad('holder metadata must be at most ' .. MAX_META .. ' bytes')
  end
  return v
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- holder record: amount|token|acquired_ms|ttl_ms|ticket|meta
local function parse_holder(rec)
  local a, tok, acq, ttl, ticket, meta = string.match(rec, '^(%d+)|(%d+)|(%d+)|(%d+)|([^|]*)|(.*)$')
  return tonumber(a), tok, acq, ttl, ticket, meta
end

-- waiter record: amount|ttl_ms|enqueued_ms|lease_id|channel|priority|meta. A record without the
-- priority (written by a version before priorities, during a rolling upgrade) reads as
-- priority 0: its meta is JSON (an object) or empty, so it cannot be taken for a priority.
local function parse_waiter(rec)
  local a, ttl, enq, lid, chan, p, meta =
    string.match(rec, '^(%d+)|(%d+)|(%d+)|(%x+)|(%w*)|(%-?%d+)|(.*)$')
  if not a then
    a, ttl, enq, lid, chan, meta = string.match(rec, '^(%d+)|(%d+)|(%d+)|(%x+)|(%w*)|(.*)$')
    p = '0'
  end
  return tonumber(a), tonumber(ttl), enq, lid, chan, meta, tonumber(p)
end

-- The queue score of a request queued now with priority `prio` (lowest goes first). The
-- arrival time is in virtual microseconds: the server clock, but strictly after the last
-- arrival's (cfg field qvt), so arrivals keep their order within a millisecond and if the
-- clock steps back. Score = arrival - prio x AGING_US: ordering by it is ordering by effective
-- priority (prio + time waited / AGING_US, the same for every waiter at any instant), then by
-- arrival. The score never changes while the request waits, so the queue stays one sorted set.
-- Returns the score and the arrival (to write to qvt when the request queues).
local function queue_score(now, prio, qvt)
  local vt = now * 1000
  if vt <= qvt then vt = qvt + 1 end
  return vt - prio * AGING_US, vt
end

local function channel_arg(v)
  if type(v) ~= 'string' or not string.match(v, '^%w+$') or #v > 32 then
    return nil, bad('channel id must be 1-32 characters of [A-Za-z0-9], got ' .. show(v))
  end
  return v
end

local function cfg_num(field)
  return tonumber(redis.call('HGET', K_CFG, field) or '0')
end

-- Grace period (docs/SEMANTICS.md): after a pool is created again because Redis lost its data, no
-- new grant is made until `grace_until` (server ms), one maximum ttl after the re-creation,
-- so that holders of leases granted before the loss can re-assert them (reassert.lua) and
-- those that cannot have given their leases up on their own clocks. Returns the ms left.
local function grace_left(now)
  local g = tonumber(redis.call('HGET', K_CFG, 'grace_until') or '0')
  if g > now then return g - now end
  return 0
end

local function drop_waiter(ticket)
  redis.call('ZREM', K_QUEUE, ticket)
  redis.call('HDEL', K_WAITERS, ticket)
  redis.call('ZREM', K_WEXP, ticket)
end

-- Remove one lease (by id) and return its bytes to the pool. Returns true if it existed.
local function drop_lease(lid)
  local rec = redis.call('HGET', K_HOLDERS, lid)
  redis.call('ZREM', K_LEASES, lid)
  if not rec then return false end
  local amount, _, _, _, ticket = parse_holder(rec)
  redis.call('HDEL', K_HOLDERS, lid)
  if ticket and ticket ~= '' then redis.call('HDEL', K_TICKETS, ticket) end
  redis.call('HINCRBY', K_CFG, 'used', fmt(-amount))
  return true
end

-- Reap what reap_lists() found: expired leases and waiters that stopped refreshing.
local function reap_found(dead, gone)
  local nl, nw = #dead, #gone
  for _, lid in ipairs(dead) do drop_lease(lid) end
  for _, t in ipairs(gone) do drop_waiter(t) end
  if nl > 0 then redis.call('HINCRBY', K_CFG, 'reaped_leases', nl) end
  if nw > 0 then redis.call('HINCRBY', K_CFG, 'reaped_waiters', nw) end
  return nl, nw
end

-- The leases whose server expiry has passed and the waiters that stopped refreshing (reads
-- only: a script reads them before its first write, see "Key types" below).
local function reap_lists(now)
  local n = fmt(now)
  return redis.call('ZRANGEBYSCORE', K_LEASES, '-inf', n), redis.call('ZRANGEBYSCORE', K_WEXP, '-inf', n)
end

-- Reap leases whose server expiry has passed and waiters that stopped refreshing.
local function reap(now)
  local dead, gone = reap_lists(now)
  return reap_found(dead, gone)
end

-- Make a lease with fencing token ``token`` (the caller takes it from the pool's fence and
-- writes the pool's counters: fence, used, grants). Returns its expiry.
local function make_lease(now, ticket, lid, amount, ttl, meta, token)
  local exp = now + ttl
  redis.call('ZADD', K_LEASES, fmt(exp), lid)
  redis.call('HSET', K_HOLDERS, lid,
    fmt(amount) .. '|' .. fmt(token) .. '|' .. fmt(now) .. '|' .. fmt(ttl) .. '|' .. ticket .. '|' .. meta)
  redis.call('HSET', K_TICKETS, ticket, lid)
  return exp
end

-- Effective capacity (docs/SEMANTICS.md, "Device truth"): while the device sampler's report is
-- live (external_until, server ms, is in the future) the pool grants at most capacity minus
-- the bytes the device shows in use outside the pool's leases; an expired report stops
-- counting, so a dead sampler cannot freeze the pool. Live leases are never revoked.
local function eff_cap(now, cap, external, external_until)
  if external > 0 and external_until > now then
    if external >= cap then return 0 end
    return cap - external
  end
  return cap
end

-- Backfill (docs/SEMANTICS.md, "Backfill"): a pool whose cfg field `policy` is 'backfill' lets
-- a later request that fits pass a head that does not, as long as the head has waited less
-- than `backfill_ms` since it queued; from then on nothing passes it (the bytes freed are kept
-- for it). A hand-off looks at most BACKFILL_DEPTH requests behind the head.
local BACKFILL_DEPTH = 32
local DEFAULT_BACKFILL_MS = 2000
local function backfill_open(now, head_enq_ms)
  local bf = redis.call('HMGET', K_CFG, 'policy', 'backfill_ms')
  return bf[1] == 'backfill' and now - tonumber(head_enq_ms) < tonumber(bf[2] or DEFAULT_BACKFILL_MS)
end

-- Server-side hand-off: grant the longest prefix of the queue (in queue order: lib.lua
-- queue_score) that fits, strictly in order (a head that does not fit blocks those behind it,
-- so none starves), then, under the backfill policy, later requests that fit (backfill_open).
-- Returns the grant lines grouped by the waiters' channels, and their count, for publish().
-- grant_from: the same with what the caller read already: the queue's head (ZRANGE 0 0), the
-- capacity, bytes used, grace_until and the effective capacity (eff_cap); it also returns the
-- bytes used afterwards. A request larger than the capacity is dropped; one that fits the
-- capacity but not the effective capacity waits.
local function grant_from(now, head, cap, used, grace_until, eff)
  local lines, n = {}, 0
  if #head == 0 then return lines, n, used end
  if grace_until > now then return lines, n, used end  -- no new grant in the grace period
  local fence, grants  -- read at the first grant; the counters are written once, at the end
  -- Grant waiter `t` (record fields parsed) a lease now.
  local function grant(t, amount, ttl, lid, chan, meta)
    if not fence then
      local c = redis.call('HMGET', K_CFG, 'fence', 'grants')
      fence, grants = tonumber(c[1] or '0'), tonumber(c[2] or '0')
    end
    drop_waiter(t)
    fence = fence + 1
    local exp = make_lease(now, t, lid, amount, ttl, meta, fence)
    used = used + amount
    n = n + 1
    local group = lines[chan]
    if not group then group = {}; lines[chan] = group end
    group[#group + 1] = t .. ' ' .. lid .. ' ' .. fmt(fence) .. ' ' .. fmt(exp) .. ' ' .. fmt(amount)
  end
  local blocked_enq  -- the enqueue time of a head that does not fit
  while true do
    if #head == 0 then break end
    local t = head[1]
    local w = redis.call('HGET', K_WAITERS, t)
    if not w then
      drop_waiter(t)
    else
      local amount, ttl, enq, lid, chan, meta = parse_waiter(w)
      if amount > cap then
        -- The capacity was lowered below this request: it can never be granted, and as head
        -- it would block everyone behind it. Drop it; its client finds it gone at its next
        -- poll, asks again and gets GPULOCK_CAPACITY.
        drop_waiter(t)
      elseif used + amount > eff then
        blocked_enq = enq
        break
      else
        grant(t, amount, ttl, lid, chan, meta)
      end
    end
    head = redis.call('ZRANGE', K_QUEUE, 0, 0)
  end
  if blocked_enq and used < eff and backfill_open(now, blocked_enq) then
    for _, t in ipairs(redis.call('ZRANGE', K_QUEUE, 1, BACKFILL_DEPTH)) do
      local w = redis.call('HGET', K_WAITERS, t)
      if w then
        local amount, ttl, _, lid, chan, meta = parse_waiter(w)
        if amount <= cap and used + amount <= eff then grant(t, amount, ttl, lid, chan, meta) end
      end
      if used >= eff then break end
    end
  end
  if n > 0 then
    redis.call('HSET', K_CFG, 'fence', fmt(fence), 'used', fmt(used), 'grants', fmt(grants + n))
  end
  return lines, n, used
end

local function grant_head(now)
  local head = redis.call('ZRANGE', K_QUEUE, 0, 0)
  if #head == 0 then return {}, 0 end
  local c = redis.call('HMGET', K_CFG, 'capacity', 'used', 'grace_until', 'external', 'external_until')
  local cap = tonumber(c[1] or '0')
  local lines, n = grant_from(now, head, cap, tonumber(c[2] or '0'), tonumber(c[3] or '0'),
                              eff_cap(now, cap, tonumber(c[4] or '0'), tonumber(c[5] or '0')))
  return lines, n
end

-- Sharded pub/sub where the server has it (Redis >= 7, Valkey >= 7.2: REDIS_VERSION_NUM is
-- set from 7.0 on): on a cluster SPUBLISH stays on the pool's shard (the channel carries the
-- pool's hash tag) where PUBLISH is broadcast to every node. The subscriber picks SSUBSCRIBE
-- by the same rule (gpulock/_listener.py).
local SHARDED = redis.REDIS_VERSION_NUM ~= nil and redis.REDIS_VERSION_NUM >= 0x070000

local function publish(now, lines, n)
  if n > 0 then
    for chan, group in pairs(lines) do
      local ch, msg = K_EVENTS .. ':' .. chan, 'g ' .. fmt(now) .. '\n' .. table.concat(group, '\n')
      if SHARDED then redis.call('SPUBLISH', ch, msg) else redis.call('PUBLISH', ch, msg) end
    end
  end
end

-- Milliseconds until the queue can next move without a release: the nearest lease expiry,
-- the end of a grace period, or the expiry of a device report that holds bytes back, whichever
-- is soonest (-1 when none).
local function next_expiry_in(now)
  local first = redis.call('ZRANGE', K_LEASES, 0, 0, 'WITHSCORES')
  local d = -1
  if #first > 0 then
    d = tonumber(first[2]) - now
    if d < 0 then d = 0 end
  end
  local g = grace_left(now)
  if g > 0 and (d < 0 or g < d) then d = g end
  local x = redis.call('HMGET', K_CFG, 'external', 'external_until')
  local xu = tonumber(x[2] or '0')
  if tonumber(x[1] or '0') > 0 and xu > now and (d < 0 or xu - now < d) then d = xu - now end
  return d
end

-- acquire's reply when it grants nothing now: {code, position, retry_after_ms, queue_len,
-- now_ms, epoch, capacity, used, held_back} (see acquire.lua).
local function not_granted(code, pos, now, epoch, cap, eff)
  return {code, pos, next_expiry_in(now), redis.call('ZCARD', K_QUEUE), now,
          epoch, cap, cfg_num('used'), cap - eff}
end

local function grant_reply(now, lid)
  local rec = redis.call('HGET', K_HOLDERS, lid)
  local amount, token = parse_holder(rec)
  local exp = redis.call('ZSCORE', K_LEASES, lid)
  return {1, lid, tonumber(token), tonumber(exp), amount, now,
          cfg_num('epoch'), cfg_num('capacity'), cfg_num('used')}
end

-- Key types. A key of another type under the pool's prefix (written by something else) would
-- make a script fail at its first use of that key, perhaps after other writes, and Redis does
-- not roll a script back. So no script writes before it has used every key it may use:
-- * acquire and release (the hot path) read each such key before their first write, with
--   redis.pcall; a read that fails goes to keytype_error(), which finds the key by TYPE
--   (so TYPE runs only on the error path);
-- * the other scripts start with check_types(): seven TYPE calls.
-- Either way a script fails with nothing written:
--   GPULOCK_KEYTYPE <key> <found type> <expected type>
local KEY_TYPES = {'hash', 'zset', 'hash', 'zset', 'hash', 'zset', 'hash'}
local function check_types()
  for i = 1, 7 do
    local t = redis.call('TYPE', POOL_KEYS[i])['ok']
    if t ~= 'none' and t ~= KEY_TYPES[i] then
      return redis.error_reply('GPULOCK_KEYTYPE ' .. POOL_KEYS[i] .. ' ' .. t .. ' ' .. KEY_TYPES[i])
    end
  end
  return nil
end

-- Whether a redis.pcall reply is an error.
local function failed(r) return type(r) == 'table' and r.err ~= nil end

-- The reply for a read (redis.pcall) that failed before the first write: GPULOCK_KEYTYPE for
-- the key of the wrong type, or the error itself when no key has one.
local function keytype_error(r)
  return check_types() or r
end
