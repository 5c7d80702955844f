-- acquire.lua: grant a lease now, or queue the request (by priority, then arrival) and report
-- its position.
-- KEYS: the eight pool keys described in lib.lua (cfg, leases, holders, queue, waiters, wexp,
--       tickets, events).
-- ARGV:
--   1 ticket          request id: the idempotency key (1-128 chars of [A-Za-z0-9._:-]). The
--                     same ticket never holds two places in the queue nor two grants.
--   2 lease_id        32 hex digits, chosen at random by the client; used if this ticket
--                     is granted (now or later by a hand-off).
--   3 amount          bytes, integer, 1 .. capacity
--   4 ttl_ms          lease time to live, milliseconds, 100 .. 86400000
--   5 waiter_ttl_ms   how long a queued ticket survives without a refresh, milliseconds
--   6 mode            'wait' (queue if it cannot be granted now) or 'try' (never queue)
--   7 meta            holder metadata (opaque string, <= 512 bytes)
--   8 channel         the caller process's channel id (1-32 of [A-Za-z0-9]): a later hand-off
--                     grant to this ticket is published on "<events key>:<channel>"
--   9 priority        integer in [-100, 100] (lib.lua PRIO_MIN, PRIO_MAX; '0' when absent),
--                     higher first; queued requests age (lib.lua queue_score). A request that
--                     would queue ahead of the queue's head is granted now if it fits; so is
--                     one behind it under the backfill policy while the head's window is open
--                     (lib.lua backfill_open).
--  10 tenant          optional: '' (none, the default) or 1-64 characters of [A-Za-z0-9._:-].
--                     The lease counts toward the tenant's bytes; where the pool has a quota
--                     for the tenant (configure.lua), a request is granted only while the
--                     tenant's leases and it fit the quota, else it waits; waiters whose
--                     tenant has no room do not block the queue (lib.lua grant_from).
--  11 device          optional: '' (any device, the default) or the index of the device the
--                     lease must be on (0 .. devices-1; on a pool of one device only 0). On a
--                     pool of several devices a request without one is placed by the pool's
--                     placement rule (lib.lua place).
--  12 kind            optional: '' (the default) or 'resident': a lease its holder keeps for its
--                     whole life (a model's weights; lib.lua "Resident leases"). A resident
--                     request is granted or queued only when it fits the capacity next to the
--                     resident leases held and queued, else answered "not resident room"
--                     (code 3) whatever its mode; a request that is not resident and can never
--                     fit next to them is refused (GPULOCK_ROOM, GPULOCK_QUOTA).
--  13 preemptible     optional: '' or '1' (the default): with the pool's preemption on, the lease
--                     may be asked to yield to a request of higher priority (lib.lua
--                     "Preemption"); '0': never. A resident lease is never asked. The request,
--                     queued at the head and unable to fit, asks holders to yield itself.
-- Reply:
--   granted:     {1, lease_id, token, expires_ms, amount, now_ms, epoch, capacity, used, device}
--                (device: the lease's device index; 0 on a pool of one device)
--   queued:      {0, position, retry_after_ms, queue_len, now_ms, epoch, capacity, used, held_back,
--                 grace_left_ms, 0, ahead_bytes, amount, bytes_per_s, grants_per_ks,
--                 ahead_count, out_of_order_pm}
--   not queued:  {2, 0, retry_after_ms, queue_len, now_ms, epoch, capacity, used, held_back,
--                 grace_left_ms, 0, ahead_bytes, amount, bytes_per_s, grants_per_ks,
--                 ahead_count, out_of_order_pm} (mode 'try'); held_back: bytes the device report holds back now
--                (capacity - effective capacity; 0 without a live report); grace_left_ms: the
--                time left in the pool's grace period (0 outside one)
--   no resident room: {3, 0, retry_after_ms, queue_len, now_ms, epoch, capacity, used,
--                held_back, grace_left_ms, resident, ahead_bytes, amount, bytes_per_s,
--                grants_per_ks, ahead_count, out_of_order_pm} (kind 'resident' only): not granted, not
--                queued; resident: the bytes of the resident leases held and queued, as
--                recounted from the records (lib.lua resident_recount)
--   The wait estimate's inputs (lib.lua "Drain rate", wait_inputs; gpulock/estimates/wait.py):
--   ahead_bytes and ahead_count: the bytes and the count of the waiters ahead of it (for a
--   request not queued: of those of the whole queue that would be; lib.lua ahead_of: in queue
--   order, less those it passes under backfill and those of other tenants at their quota; the
--   first 32 walked, lib.lua AHEAD_DEPTH, the rest extrapolated), amount: this request's
--   bytes, bytes_per_s and grants_per_ks: the pool's drain rate in bytes per second and grants
--   per 1000 seconds of busy time (0, 0: not measured yet), out_of_order_pm: per mille of its
--   grants that went out of arrival order.
--   retry_after_ms is, in a grace period, the time to its end; else the time to the nearest
--   lease expiry (-1 when none): a lower bound on when the queue can move if nobody releases.
--   In a grace period (see configure.lua, reassert.lua) nothing is granted: requests queue.
--   While a device report is live (external.lua) a request is granted only if it fits the
--   effective capacity (capacity - external, lib.lua eff_cap); one that fits the capacity but
--   not the effective capacity queues.
-- Errors (nothing is written when one is returned, but for a repair of the resident counters
-- before GPULOCK_ROOM or GPULOCK_QUOTA: lib.lua resident_recount):
--   GPULOCK_BADARG <why>                 an argument is malformed or out of range, or the ttl
--                                        is longer than the pool's max_ttl_ms
--   GPULOCK_NOPOOL                       the pool has no configuration (never configured, or
--                                        Redis lost its data)
--   GPULOCK_CAPACITY <amount> <capacity> the amount can never fit the pool; on a pool of several
--                                        devices "... device <i>" (the capacity of its pinned
--                                        device i) or "... device any" (of the largest device)
--   GPULOCK_QUOTA <amount> <quota> <tenant> [<resident>] the amount exceeds the tenant's quota
--                                        (or, with <resident>, what the tenant's resident
--                                        leases leave of it)
--   GPULOCK_ROOM <amount> <room> <capacity> <resident>[ device <i|any>]  not resident, the
--                                        amount fits the capacity but not what the resident
--                                        leases held and queued leave (lib.lua room_refusal)
--   GPULOCK_QUEUEFULL <queue_len> <max>  the queue is at max_waiters
--   GPULOCK_CONFLICT <why>               the ticket is in use with another amount, tenant or device, or the
--                                        lease id is in use by another ticket

local ticket, e = id_arg(ARGV[1], 'ticket'); if e then return e end
local lid; lid, e = lease_id_arg(ARGV[2]); if e then return e end
local amount; amount, e = int_arg(ARGV[3], 'amount', 1, MAX_AMOUNT); if e then return e end
local ttl; ttl, e = int_arg(ARGV[4], 'ttl_ms', MIN_TTL_MS, MAX_TTL_MS); if e then return e end
local wttl; wttl, e = int_arg(ARGV[5], 'waiter_ttl_ms', MIN_TTL_MS, MAX_TTL_MS); if e then return e end
local mode = ARGV[6]
if mode ~= 'wait' and mode ~= 'try' then return bad("mode must be 'wait' or 'try', got " .. show(mode)) end
local meta; meta, e = meta_arg(ARGV[7]); if e then return e end
local chan; chan, e = channel_arg(ARGV[8]); if e then return e end
local prio = 0
if ARGV[9] ~= nil and ARGV[9] ~= '0' then prio, e = prio_arg(ARGV[9]); if e then return e end end
local tenant; tenant, e = tenant_arg(ARGV[10]); if e then return e end
local pin = ARGV[11] or ''
if pin ~= '' and (not string.match(pin, '^%d+$') or #pin > 2) then
  return bad('device must be a device index (0, 1, ...), got ' .. show(pin))
end
local res = ARGV[12] == 'resident'
if not res and ARGV[12] ~= nil and ARGV[12] ~= '' then
  return bad("kind must be '' or 'resident', got " .. show(ARGV[12]))
end
local keep = ARGV[13] == '0'  -- never asked to yield
if not keep and ARGV[13] ~= nil and ARGV[13] ~= '' and ARGV[13] ~= '1' then
  return bad("preemptible must be '1' or '0', got " .. show(ARGV[13]))
end

-- Reads first: every key this call may use is read (redis.pcall) before the first write, so a
-- key of the wrong type fails it with nothing written (see "Key types" in lib.lua). The queue's
-- keys (waiters, wexp) are read only when the queue is not empty or the request may queue: an
-- empty queue has no waiters (the three queue keys change together, in drop_waiter and below).
local cfg = redis.pcall('HMGET', K_CFG, 'capacity', 'used', 'fence', 'grants', 'max_ttl_ms',
                        'grace_until', 'external', 'external_until', 'epoch', 'max_waiters',
                        'nquotas', 'devices', 'placement', 'resident', 'rqueued', 'preempt', 'kept')
if failed(cfg) then return keytype_error(cfg) end
if not cfg[1] then return redis.error_reply('GPULOCK_NOPOOL') end
local cap = tonumber(cfg[1])
local d = load_devices(cfg[12], cfg[13])  -- nil: a pool of one device
if pin ~= '' then
  local n = d and d.n or 1
  if tonumber(pin) >= n then
    return bad('device ' .. pin .. ' is not a device of the pool: it has ' .. fmt(n) .. ' (0 .. ' .. fmt(n - 1) .. ')')
  end
  pin = d and fmt(tonumber(pin)) or ''  -- device 0 of a pool of one device is the pool
end
local most = cap
if d then most = device_max(d, pin) end
if amount > most then
  local which = ''
  if d then which = ' device ' .. (pin ~= '' and pin or 'any') end
  return redis.error_reply('GPULOCK_CAPACITY ' .. fmt(amount) .. ' ' .. fmt(most) .. which)
end
local quotas = cfg[11] ~= false and cfg[11] ~= '0'
local room = {}  -- lib.lua quota_check's cache
if quotas and quota_check(room, tenant, amount, true) == 'never' then
  return redis.error_reply('GPULOCK_QUOTA ' .. fmt(amount) .. ' ' .. fmt(room[tenant][1]) .. ' ' .. tenant)
end
local max_ttl = tonumber(cfg[5] or '0')
if max_ttl > 0 and ttl > max_ttl then
  return bad('ttl_ms ' .. fmt(ttl) .. " exceeds the pool's max_ttl_ms " .. fmt(max_ttl))
end
local held = redis.pcall('HGET', K_TICKETS, ticket)
if failed(held) then return keytype_error(held) end
local r
if held then
  r = redis.pcall('HGET', K_HOLDERS, held)
  if failed(r) then return keytype_error(r) end
  if r then
    local a, _, _, _, _, _, tn, dv = parse_holder(r)
    if a ~= amount or tn ~= tenant or (pin ~= '' and dv ~= pin) then
      return redis.error_reply('GPULOCK_CONFLICT request id ' .. ticket .. ' holds a lease of another amount, tenant or device')
    end
  end
end
local qlen = redis.pcall('ZCARD', K_QUEUE)
if failed(qlen) then return keytype_error(qlen) end
local w
if qlen > 0 then
  w = redis.pcall('HGET', K_WAITERS, ticket)
  if failed(w) then return keytype_error(w) end
  if w then
    local a, _, _, _, _, _, _, tn, dv = parse_waiter(w)
    if a ~= amount or tn ~= tenant or (pin ~= '' and dv ~= pin) then
      return redis.error_reply('GPULOCK_CONFLICT request id ' .. ticket .. ' is queued for another amount, tenant or device')
    end
  end
end
if not held then
  r = redis.pcall('HEXISTS', K_HOLDERS, lid)
  if failed(r) then return keytype_error(r) end
  if not w and r == 1 then
    return redis.error_reply('GPULOCK_CONFLICT lease id is already in use')
  end
end
local now = now_ms()
local nstr = fmt(now)
local dead = redis.pcall('ZRANGEBYSCORE', K_LEASES, '-inf', nstr)
if failed(dead) then return keytype_error(dead) end
local used, grace_until = tonumber(cfg[2] or '0'), tonumber(cfg[6] or '0')
local eff = eff_cap(now, cap, tonumber(cfg[7] or '0'), tonumber(cfg[8] or '0'))
local gone = {}
if qlen > 0 then
  gone = redis.pcall('ZRANGEBYSCORE', K_WEXP, '-inf', nstr)
  if failed(gone) then return keytype_error(gone) end
elseif mode == 'wait' and (used + amount > eff or grace_until > now) then
  -- It may queue (reaping can only make room): the queue's other keys are written then.
  r = redis.pcall('HEXISTS', K_WAITERS, ticket)
  if failed(r) then return keytype_error(r) end
  r = redis.pcall('ZSCORE', K_WEXP, ticket)
  if failed(r) then return keytype_error(r) end
end
if not res and not held and not w then
  -- a new request that can never be granted next to the resident leases: refused at once
  local rh, rq = tonumber(cfg[14] or '0'), tonumber(cfg[15] or '0')
  if amount > cap - rh - rq or d or (quotas and tenant ~= '') then
    r = room_refusal(amount, tenant, pin, cap, rh, rq, d, quotas, room, dead, gone)
    if r then return r end
  end
end

-- Validation and reads done; writes start here.
local fence, grants = tonumber(cfg[3] or '0'), tonumber(cfg[4] or '0')
if #dead + #gone > 0 then
  reap_found(dead, gone)
  -- Every script that frees bytes hands them on before it returns, so the queue can only
  -- have become grantable here if this reap freed something.
  publish(now, grant_head(now))
  held = redis.call('HGET', K_TICKETS, ticket)
  qlen = redis.call('ZCARD', K_QUEUE)
  local c = redis.call('HMGET', K_CFG, 'used', 'fence', 'grants')
  used, fence, grants = tonumber(c[1] or '0'), tonumber(c[2] or '0'), tonumber(c[3] or '0')
  room = {}  -- the reap and hand-off changed what tenants hold
  if d then d = load_devices(cfg[12], cfg[13]) end  -- and what devices hold
end

local epoch = cfg[9]  -- replied as read: no conversion on the hot path
if held and redis.call('HEXISTS', K_HOLDERS, held) == 1 then
  return grant_reply(now, held)
end

if qlen > 0 and redis.call('ZSCORE', K_QUEUE, ticket) then
  redis.call('ZADD', K_WEXP, fmt(now + wttl), ticket)
  local pos = redis.call('ZRANK', K_QUEUE, ticket) + 1
  if pos == 1 and cfg[16] then ask_yield(now, cfg[16]) end
  if cfg[17] then tell_kept(now, cfg[17]) end  -- lib.lua "Kept bytes"
  return not_granted(0, pos, now, epoch, cap, eff, nil, amount, tenant)
end
if res then
  -- a resident request waits only where it fits next to the resident leases held and queued
  local c = redis.call('HMGET', K_CFG, 'resident', 'rqueued')
  local rsv = tonumber(c[1] or '0') + tonumber(c[2] or '0')
  if amount > cap - rsv then  -- recounted from the records before it answers (lib.lua resident_recount)
    local x = resident_recount()
    rsv = x.held + x.queued
    if amount > cap - rsv then return not_granted(3, 0, now, epoch, cap, eff, rsv, amount, tenant) end
  end
end

-- Granted now when it fits and would be ahead of the queue's front (lib.lua grant_test).
local now_ok, dev, score, vt = grant_test(now, amount, prio, tenant, pin, res, used, eff, grace_until,
                                          qlen, d, quotas, room)
if now_ok then
  -- make_lease, with the counters read above written in one HSET
  local token, exp = fence + 1, now + ttl
  used = used + amount
  redis.call('HSET', K_CFG, 'fence', fmt(token), 'used', fmt(used), 'grants', fmt(grants + 1))
  redis.call('ZADD', K_LEASES, fmt(exp), lid)
  redis.call('HSET', K_HOLDERS, lid, holder_record(amount, token, now, ttl, ticket, tenant, meta, dev, res))
  local pre = pre_value(prio, chan, res, keep)  -- lib.lua "Preemption"
  if score and pre then  -- granted ahead of waiters: its place is its score (lib.lua lease_place)
    redis.call('HSET', K_TICKETS, ticket, lid, place_field(lid), fmt(score), pre_field(lid), pre)
  elseif score then
    redis.call('HSET', K_TICKETS, ticket, lid, place_field(lid), fmt(score))
  elseif pre then
    redis.call('HSET', K_TICKETS, ticket, lid, pre_field(lid), pre)
  else
    redis.call('HSET', K_TICKETS, ticket, lid)
  end
  tenant_add(tenant, amount)
  device_add(dev, amount)
  if res then resident_add(tenant, dev, amount) end
  return {1, lid, token, exp, amount, now, epoch, cap, used, tonumber(dev) or 0}
end
if mode == 'try' then
  if cfg[17] then tell_kept(now, cfg[17]) end  -- lib.lua "Kept bytes": a retry may fit then
  return not_granted(2, 0, now, epoch, cap, eff, nil, amount, tenant)
end

local maxw = tonumber(cfg[10])
if qlen >= maxw then
  return redis.error_reply('GPULOCK_QUEUEFULL ' .. fmt(qlen) .. ' ' .. fmt(maxw))
end
if not score then
  score, vt = queue_score(now, prio, tonumber(redis.call('HGET', K_CFG, 'qvt') or '0'))
end
if qlen == 0 then  -- the queue goes busy now (lib.lua "Drain rate": dr_q)
  redis.call('HSET', K_CFG, 'qvt', fmt(vt), 'dr_q', fmt(now))
else
  redis.call('HSET', K_CFG, 'qvt', fmt(vt))
end
redis.call('ZADD', K_QUEUE, fmt(score), ticket)
redis.call('HSET', K_WAITERS, ticket, fmt(amount) .. '|' .. fmt(ttl) .. '|' .. nstr .. '|' .. lid .. '|' .. chan .. '|'
  .. fmt(prio) .. '|' .. tenant .. '|' .. pin .. (res and 'r' or (keep and 'n' or '')) .. '|' .. meta)
if res then count_field('rqueued', amount) end
redis.call('ZADD', K_WEXP, fmt(now + wttl), ticket)
local pos = 1
if qlen > 0 then pos = redis.call('ZRANK', K_QUEUE, ticket) + 1 end
if pos == 1 and cfg[16] then ask_yield(now, cfg[16]) end  -- lib.lua "Preemption"
if cfg[17] then tell_kept(now, cfg[17]) end  -- lib.lua "Kept bytes": nobody waits behind them
return not_granted(0, pos, now, epoch, cap, eff, nil, amount, tenant)
