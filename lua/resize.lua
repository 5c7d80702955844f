-- resize.lua: change a held lease's amount (docs/SEMANTICS.md, "Resizing a lease").
-- (KEYS and ARGV: see below; KEYS are the eight pool keys of lib.lua.)
-- A shrink is granted at once and its freed bytes go to the queue as a release's do (lib.lua
-- grant_head); a growth takes the difference through the rules of a request of that size of
-- the lease's tenant and device, ordered at the lease's place in the queue (lib.lua
-- lease_place: ahead of the new requests the lease's request was ahead of) (lib.lua
-- grant_test): granted now, or queued at that score as a growth waiter (lib.lua parse_waiter,
-- 'g'), which a later hand-off grants (lib.lua grant_from) by adding the difference to the
-- lease. The lease keeps its id and token. Idempotent by the target amount: sent again it
-- refreshes a growth queued for that amount, or answers the grant made to it.
-- KEYS: the eight pool keys described in lib.lua.
-- ARGV:
--   1 ticket          the lease's growth ticket: 'grow:' .. lease_id (lib.lua grow_ticket)
--   2 lease_id        32 hex digits
--   3 amount          the lease's new amount, bytes, integer >= 1
--   4 ttl_ms          the lease's ttl (100 .. 86400000), or '' (the ttl in its record): a reply
--                     that grants renews it to now + ttl
--   5 waiter_ttl_ms   how long a queued growth survives without a refresh, milliseconds
--   6 mode            'wait' (queue a growth that cannot be granted now) or 'try' (never queue)
--   7 token           the lease's fencing token (decimal), or '' (any: the lease id is the
--                     capability, as for a proxy's remote holders)
--   8 channel         the caller process's channel id: a hand-off grant of the growth is
--                     published on "<events key>:<channel>" as the new amount
--   9 priority        integer in [-100, 100]: the lease's priority (its acquire's); it places
--                     the growth only where the lease has no place stored (lib.lua lease_place)
-- Amount <= the lease's: a growth queued for the lease is withdrawn first (a shrink back to
-- the amount before a growth undoes it, also one whose grant raced in).
-- Reply (acquire.lua's shapes, so that a growth waiter is refreshed and re-queued as an
-- acquire's is):
--   granted:     {1, lease_id, token, expires_ms, amount, now_ms, epoch, capacity, used, device}
--                the lease has `amount` now (renewed: expires_ms = now + ttl_ms)
--   queued:      {0, position, retry_after_ms, queue_len, now_ms, epoch, capacity, used,
--                 held_back, grace_left_ms, current, ahead_bytes, delta, bytes_per_s,
--                 grants_per_ks, ahead_count, out_of_order_pm}   the growth waits; current:
--                 the lease's amount meanwhile; the last six as acquire.lua's (delta: the
--                 bytes the lease grows by)
--   not queued:  {2, 0, ...same...}                     (mode 'try')
-- Errors (nothing written, but the reap of expired leases and gone waiters, and the hand-off,
-- which any script makes):
--   GPULOCK_BADARG <why>      a bad argument, a resident lease (never resized), or a growth of a
--                             lease asked to yield (lib.lua "Preemption"; it may shrink, and its
--                             expiry is never renewed past its yield deadline)
--   GPULOCK_NOPOOL            the pool has no configuration
--   GPULOCK_LOST <lease_id>   no such live lease (released, expired, never existed, another
--                             token)
--   GPULOCK_CAPACITY, GPULOCK_QUOTA, GPULOCK_ROOM   the new amount can never fit (as
--                             acquire.lua's, for the lease's device and tenant)
--   GPULOCK_QUEUEFULL <queue_len> <max>
--   GPULOCK_CONFLICT <why>    a growth of the lease to another amount is queued
--   GPULOCK_RESIZE_REFUSED <amount> <current> <device> <lease_id>   the growth cannot be granted now,
--                             every other lease holding bytes on the device is resident or waits
--                             to grow, and no growth there fits the free bytes: nothing could
--                             free bytes for it (docs/SEMANTICS.md). Where one fits, the
--                             hand-off grants it (lib.lua grant_from): this growth, answered
--                             granted, or another, and this one waits.

local type_err = check_types(); if type_err then return type_err end
local lid, e = lease_id_arg(ARGV[2]); if e then return e end
local ticket = ARGV[1]
if ticket ~= grow_ticket(lid) then
  return bad("ticket must be '" .. grow_ticket(lid) .. "', got " .. show(ticket))
end
local amount; amount, e = int_arg(ARGV[3], 'amount', 1, MAX_AMOUNT); if e then return e end
local ttl
if ARGV[4] ~= nil and ARGV[4] ~= '' then
  ttl, e = int_arg(ARGV[4], 'ttl_ms', MIN_TTL_MS, MAX_TTL_MS); if e then return e end
end
local wttl; wttl, e = int_arg(ARGV[5], 'waiter_ttl_ms', MIN_TTL_MS, MAX_TTL_MS); if e then return e end
local mode = ARGV[6]
if mode ~= 'wait' and mode ~= 'try' then return bad("mode must be 'wait' or 'try', got " .. show(mode)) end
local token
if ARGV[7] ~= nil and ARGV[7] ~= '' then
  token, e = int_arg(ARGV[7], 'token', 0, MAX_AMOUNT); if e then return e end
end
local chan; chan, e = channel_arg(ARGV[8]); if e then return e end
local prio = 0
if ARGV[9] ~= nil and ARGV[9] ~= '0' then prio, e = prio_arg(ARGV[9]); if e then return e end end

local cfg = redis.call('HMGET', K_CFG, 'capacity', 'max_ttl_ms', 'nquotas', 'devices', 'placement',
                       'resident', 'rqueued', 'epoch', 'max_waiters')
if not cfg[1] then return redis.error_reply('GPULOCK_NOPOOL') end
local cap = tonumber(cfg[1])
local max_ttl = tonumber(cfg[2] or '0')
if ttl and max_ttl > 0 and ttl > max_ttl then
  return bad('ttl_ms ' .. fmt(ttl) .. " exceeds the pool's max_ttl_ms " .. fmt(max_ttl))
end
local now = now_ms()
local rec = redis.call('HGET', K_HOLDERS, lid)
local exp0 = redis.call('ZSCORE', K_LEASES, lid)
local cur, tok, acq, rttl, tenant, dev, res, _
if rec then cur, tok, acq, rttl, _, _, tenant, dev, res = parse_holder(rec) end
if not rec or not exp0 or tonumber(exp0) <= now or (token and tonumber(tok) ~= token) then
  return redis.error_reply('GPULOCK_LOST ' .. lid)
end
ttl = ttl or tonumber(rttl)
if res then
  return bad('lease ' .. lid .. ' is resident: a resident lease is never resized (release it and acquire the new amount)')
end
local ydl = yield_deadline(lid)  -- asked to yield (lib.lua "Preemption"): it may shrink, not grow
if ydl and amount > cur then
  return bad('lease ' .. lid .. ' was asked to yield: it may shrink (the ask stands) or be released, not grow to '
    .. fmt(amount) .. ' bytes')
end
local d = load_devices(cfg[4], cfg[5])  -- nil: a pool of one device
local quotas = cfg[3] ~= false and cfg[3] ~= '0'
local room = {}  -- lib.lua quota_check's cache
local dead, gone = reap_lists(now)
if amount > cur then
  -- a new amount that can never fit: refused at once, as acquire refuses such an amount
  local most = cap
  if d then most = device_max(d, dev) end
  if amount > most then
    return redis.error_reply('GPULOCK_CAPACITY ' .. fmt(amount) .. ' ' .. fmt(most) .. (d and (' device ' .. dev) or ''))
  end
  if quotas and quota_check(room, tenant, amount, true) == 'never' then
    return redis.error_reply('GPULOCK_QUOTA ' .. fmt(amount) .. ' ' .. fmt(room[tenant][1]) .. ' ' .. tenant)
  end
  local r = room_refusal(amount, tenant, dev, cap, tonumber(cfg[6] or '0'), tonumber(cfg[7] or '0'), d,
                         quotas, room, dead, gone)
  if r then return r end
end

-- Validation done; writes start here: the reap and its hand-off, as every script makes them.
if #dead + #gone > 0 then
  reap_found(dead, gone)
  publish(now, grant_head(now))
  room = {}
end

local qlen = redis.call('ZCARD', K_QUEUE)
local queued = qlen > 0 and redis.call('HGET', K_WAITERS, ticket)
local function current_reply(code, pos)
  local c = redis.call('HMGET', K_CFG, 'external', 'external_until')
  local eff = eff_cap(now, cap, tonumber(c[1] or '0'), tonumber(c[2] or '0'))
  return not_granted(code, pos, now, cfg[8], cap, eff, cur, math.max(0, amount - cur), tenant)
end
local function granted()
  local exp = now + ttl
  if ydl and exp > ydl then exp = ydl end  -- never renewed past its yield deadline
  redis.call('ZADD', K_LEASES, 'XX', fmt(exp), lid)
  return grant_reply(now, lid)
end

if queued then
  local delta = parse_waiter(queued)
  if amount > cur and cur + delta == amount then
    -- the same growth again: refresh its place
    redis.call('ZADD', K_WEXP, fmt(now + wttl), ticket)
    return current_reply(0, redis.call('ZRANK', K_QUEUE, ticket) + 1)
  end
  if amount > cur then
    return redis.error_reply('GPULOCK_CONFLICT lease ' .. lid .. ' waits to grow to ' .. fmt(cur + delta)
                             .. ' bytes already')
  end
  drop_waiter(ticket, 0, true)  -- withdrawn: the lease stays at `amount` or below
  qlen = qlen - 1
end

if amount <= cur then
  if amount < cur then
    -- a shrink: the bytes go to the queue as a release's do
    grow_lease(lid, amount - cur)
    redis.call('HINCRBY', K_CFG, 'used', fmt(amount - cur))
  end
  -- a shrink's bytes, or the place of a growth withdrawn (it may have blocked the queue's
  -- front), go to the queue as a cancel's do
  if amount < cur or queued then publish(now, grant_head(now)) end
  return granted()
end

-- A growth: its difference is a request of `delta` bytes at the lease's tenant and device
-- (pinned to it), ordered at its lease's place in the queue (lib.lua lease_place; `prio`, the
-- lease's priority, counts where no place is stored): ahead of the new requests its lease's
-- request was ahead of, behind those of higher effective priority (docs/SEMANTICS.md,
-- "Resizing a lease").
local delta = amount - cur
local c = redis.call('HMGET', K_CFG, 'used', 'grace_until', 'external', 'external_until')
local used, grace_until = tonumber(c[1] or '0'), tonumber(c[2] or '0')
local eff = eff_cap(now, cap, tonumber(c[3] or '0'), tonumber(c[4] or '0'))
if d then d = load_devices(cfg[4], cfg[5]) end
local score = lease_place(lid, acq, prio)
local now_ok = grant_test(now, delta, prio, tenant, dev, false, used, eff, grace_until, qlen, d, quotas, room,
                          score)
if now_ok then
  grow_lease(lid, delta)
  redis.call('HSET', K_CFG, 'used', fmt(used + delta))
  return granted()
end
if mode == 'try' then
  tell_kept(now, redis.call('HGET', K_CFG, 'kept'))  -- lib.lua "Kept bytes"
  return current_reply(2, 0)
end

local function enqueue()
  if qlen == 0 then redis.call('HSET', K_CFG, 'dr_q', fmt(now)) end  -- lib.lua "Drain rate"
  redis.call('ZADD', K_QUEUE, fmt(score), ticket)
  redis.call('HSET', K_WAITERS, ticket, fmt(delta) .. '|' .. fmt(ttl) .. '|' .. fmt(now) .. '|' .. lid .. '|'
    .. chan .. '|' .. fmt(prio) .. '|' .. tenant .. '|' .. dev .. 'g|')
  redis.call('ZADD', K_WEXP, fmt(now + wttl), ticket)
  count_field('gqueued', 1)
end
local maxw = tonumber(cfg[9])
local ndev = d and d.n or 1

-- The growth would wait. Where no other lease on its device may free bytes (lib.lua
-- growth_scan: each is resident or waits to grow), its device is stuck once it waits too:
-- the hand-off's rule for a stuck device then grants the growths there that fit, in queue
-- order, this one among them (lib.lua grant_from). If that grants none of them, nothing could
-- ever free bytes for this one: it is refused (the deadlock rule; the last to join such a
-- cycle), and its place is taken back. Not in a grace period: the leases of before the loss
-- are still being put back then.
if grace_until <= now and not growth_scan(ndev, lid, dev)[dev] then
  enqueue()
  local lines, n, mine = grant_head(now, ticket)
  publish(now, lines, n)
  if mine then return granted() end
  if not growth_scan(ndev, lid, dev)[dev] then
    drop_waiter(ticket, 0, true)
    return redis.error_reply('GPULOCK_RESIZE_REFUSED ' .. fmt(amount) .. ' ' .. fmt(cur) .. ' '
                             .. (dev ~= '' and dev or '0') .. ' ' .. lid)
  end
  -- another growth there was granted: that lease may free bytes now, so this one waits
  if redis.call('ZCARD', K_QUEUE) - 1 >= maxw then
    drop_waiter(ticket, 0, true)
    return redis.error_reply('GPULOCK_QUEUEFULL ' .. fmt(qlen) .. ' ' .. fmt(maxw))
  end
else
  if qlen >= maxw then
    return redis.error_reply('GPULOCK_QUEUEFULL ' .. fmt(qlen) .. ' ' .. fmt(maxw))
  end
  enqueue()
end
tell_kept(now, redis.call('HGET', K_CFG, 'kept'))  -- lib.lua "Kept bytes": nobody waits behind them
return current_reply(0, redis.call('ZRANK', K_QUEUE, ticket) + 1)
