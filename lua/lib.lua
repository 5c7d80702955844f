-- lib.lua: helpers shared by every gpulock operation. Not an operation of its own: the loader
-- (gpulock/transport/scripts.py) builds each operation from this file and the operation's file, as a
-- function of the gpulock library and as a script (see bind() below), so every operation sees
-- the same KEYS layout and helpers.
--
-- KEYS (the same eight, in this order, for every script; one hash tag per pool):
--   1 gpulock:{pool}:cfg      hash  capacity, used, fence, epoch, qvt, max_waiters, created_ms,
--                                   grants, reaped_leases, reaped_waiters; the device sampler's
--                                   report (external.lua): external, external_until, overuse,
--                                   dev_sampler, dev_sampler_until; tenant quotas (see
--                                   "Tenant quotas" below): nquotas, quota:<tenant>,
--                                   tused:<tenant>; devices (see "Devices" below): devices,
--                                   placement, dcap:<i>, dused:<i>; resident leases (see
--                                   "Resident leases" below): resident, rqueued, dres:<i>,
--                                   tres:<tenant>; growths queued (see "Leases that wait to
--                                   grow" below): gqueued; the queue's drain rate (see
--                                   "Drain rate" below): dr_b, dr_g, dr_t, dr_at, dr_o
--   2 gpulock:{pool}:leases   zset  lease id -> server expiry (ms)
--   3 gpulock:{pool}:holders  hash  lease id -> "amount|token|acquired_ms|ttl_ms|ticket|tenant|device|meta"
--                                   (device: '' on a pool of one device, followed by 'r' for
--                                   a resident lease)
--   4 gpulock:{pool}:queue    zset  ticket -> queue score (lowest first): its arrival time in
--                                   virtual microseconds minus priority x AGING_US (see
--                                   queue_score below)
--   5 gpulock:{pool}:waiters  hash  ticket -> "amount|ttl_ms|enqueued_ms|lease_id|channel|priority|tenant|device|meta"
--                                   (tenant: '' for none; device: the device the request pins,
--                                   '' for any, followed by 'r' for a resident request)
--   6 gpulock:{pool}:wexp     zset  ticket -> waiter expiry (ms)
--   7 gpulock:{pool}:tickets  hash  ticket -> lease id of the grant made to that ticket; and
--                                   place:<lease id> -> the queue score of the request a
--                                   lease was granted to (see lease_place below)
--   8 gpulock:{pool}:events   prefix of the pub/sub channels: a grant made to a queued ticket is
--                             published on "<events>:<channel>", the channel id its process gave
--                             to acquire (one channel per waiting process, so a hand-off wakes
--                             only the process that waits for it), as
--                             "g <now_ms>\n<ticket> <lease_id> <token> <expires_ms> <amount>[ <device>]\n..."
--                             (the device only on a pool of several devices)
-- Units: amounts in bytes (integers), times in milliseconds of the Redis server clock.
-- Numbers are always formatted with fmt() before they reach redis.call: Lua would print a
-- double such as a fencing token as "1.7e+15" and lose digits.

-- The pool's keys, bound by bind() at the start of every call: the loader (gpulock/transport/scripts.py)
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
-- Preemption (see "Preemption" below): the priority gap a waiter needs over a holder, and the
-- yield grace, ms.
local PREEMPT_GAP_MIN, PREEMPT_GAP_MAX = 1, 200
local MIN_YIELD_GRACE_MS, MAX_YIELD_GRACE_MS = 100, 86400000
-- A pool's queue bound (cfg field max_waiters).
local MIN_WAITERS, MAX_WAITERS = 1, 1000000
-- A pool's queue policy and placement (cfg fields policy and placement; see "Backfill" and
-- "Devices" below): configure.lua takes one of these, a pool created has the first.
local POLICIES = {'fifo', 'backfill'}
local PLACEMENTS = {'bestfit', 'spread'}
-- The bounds, the defaults and the choices above are gpulock's vocabulary
-- (gpulock_common/options.py); tests/unit/test_vocabulary.py checks that both say the same.

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

-- Whether `v` is one of `choices`; the error reply naming them when it is not.
local function one_of(v, choices, name)
  for _, c in ipairs(choices) do
    if v == c then return v end
  end
  return nil, bad(name .. " must be '" .. table.concat(choices, "' or '") .. "', got " .. show(v))
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

-- A tenant: '' (none) or 1-64 characters of [A-Za-z0-9._:-] (never '|', '{' or '"', so a
-- record's tenant field cannot be taken for its JSON meta).
local function tenant_arg(v)
  if v == nil or v == '' then return '' end
  if type(v) ~= 'string' or #v > 64 or not string.match(v, '^[%w%-_.:]+$') then
    return nil, bad('tenant must be 1-64 characters of [A-Za-z0-9._:-], got ' .. show(v))
  end
  return v
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

-- holder record: amount|token|acquired_ms|ttl_ms|ticket|tenant|device|meta, the device
-- followed by 'r' for a resident lease. A record without the device, or without the tenant too
-- (written by an earlier version), reads as device '' and tenant '', not resident: its meta is
-- JSON (an object) or empty, so it cannot be taken for either. Returns the device as a string
-- ('' or a decimal index), then whether the lease is resident.
local function parse_holder(rec)
  local a, tok, acq, ttl, ticket, tenant, dev, r, meta =
    string.match(rec, '^(%d+)|(%d+)|(%d+)|(%d+)|([^|]*)|([%w%-_.:]*)|(%d*)(r?)|(.*)$')
  if not a then
    a, tok, acq, ttl, ticket, tenant, meta =
      string.match(rec, '^(%d+)|(%d+)|(%d+)|(%d+)|([^|]*)|([%w%-_.:]*)|(.*)$')
    dev = ''
  end
  if not a then
    a, tok, acq, ttl, ticket, meta = string.match(rec, '^(%d+)|(%d+)|(%d+)|(%d+)|([^|]*)|(.*)$')
    tenant = ''
  end
  return tonumber(a), tok, acq, ttl, ticket, meta, tenant, dev, r == 'r'
end

-- waiter record: amount|ttl_ms|enqueued_ms|lease_id|channel|priority|tenant|device|meta, the
-- device followed by 'r' for a resident request, by 'n' for a request whose lease may never be
-- asked to yield (see "Preemption" below), or by 'g' for the growth of a held lease
-- (resize.lua: amount is then the bytes the lease grows by, lease_id the lease's own id, the
-- device the lease's; its ticket is grow_ticket(lease_id)). A record without the device, the
-- tenant or the priority (written by an earlier version, during a rolling upgrade), reads as
-- device '' (any), tenant '', priority 0, not resident: its meta is JSON (an object) or
-- empty, so it cannot be taken for either. Returns the device as a string, then whether it is
-- resident, then whether it is a growth, then whether its lease may never be asked to yield.
local function parse_waiter(rec)
  local a, ttl, enq, lid, chan, p, tenant, dev, r, meta =
    string.match(rec, '^(%d+)|(%d+)|(%d+)|(%x+)|(%w*)|(%-?%d+)|([%w%-_.:]*)|(%d*)([rgn]?)|(.*)$')
  if not a then
    a, ttl, enq, lid, chan, p, tenant, meta =
      string.match(rec, '^(%d+)|(%d+)|(%d+)|(%x+)|(%w*)|(%-?%d+)|([%w%-_.:]*)|(.*)$')
  end
  if not a then
    a, ttl, enq, lid, chan, p, meta =
      string.match(rec, '^(%d+)|(%d+)|(%d+)|(%x+)|(%w*)|(%-?%d+)|(.*)$')
    tenant = ''
  end
  if not a then
    a, ttl, enq, lid, chan, meta = string.match(rec, '^(%d+)|(%d+)|(%d+)|(%x+)|(%w*)|(.*)$')
    p = '0'
  end
  return tonumber(a), tonumber(ttl), enq, lid, chan, meta, tonumber(p), tenant, dev or '', r == 'r', r == 'g',
    r == 'n'
end

-- The queue ticket of the growth of lease `lid` (resize.lua): one per lease, so a script can
-- tell whether a lease waits to grow.
local function grow_ticket(lid) return 'grow:' .. lid end

-- A lease's place in the queue (docs/SEMANTICS.md, "Resizing a lease"): its growths are
-- queued with this score, so that a growth is ordered where its lease's request was, ahead of
-- every new request that request was ahead of (admitted work grows before new work is
-- admitted). A lease granted to a queued request, or at once while others waited, keeps that
-- request's queue score in the tickets hash under place_field(lease id) (written with the
-- grant, deleted with the lease: drop_lease, release.lua). A lease granted at once to an empty
-- queue (or put back by reassert.lua, or granted by an earlier version) has none stored: its
-- place is the score of a request of its priority `prio` arriving just before `acq`, the
-- millisecond of its grant (every request queued later scores higher at that priority).
local function place_field(lid) return 'place:' .. lid end

local function lease_place(lid, acq, prio)
  local s = redis.call('HGET', K_TICKETS, place_field(lid))
  if s then return tonumber(s) end
  return tonumber(acq) * 1000 - 1 - prio * AGING_US
end

-- Preemption (docs/SEMANTICS.md, "Preemption") keeps two fields per lease in the tickets hash:
-- pre_field(lid) = "<priority>|<channel>" for a lease that may be asked to yield, written with
-- its grant (the priority of its request, the channel of the process that asked for it); a
-- resident lease, one acquired as not preemptible, or one granted by an earlier version has
-- none and is never asked. yield_field(lid) = "<asked_ms>|<deadline_ms>" once it has been
-- asked. Both go with the lease (drop_lease, release.lua).
local function pre_field(lid) return 'pr:' .. lid end
local function yield_field(lid) return 'y:' .. lid end

-- The preemption field of a lease granted to a request of priority `prio` from channel `chan`:
-- nil for a resident lease or one that may never be asked (`keep`).
local function pre_value(prio, chan, res, keep)
  if res or keep then return nil end
  return fmt(prio or 0) .. '|' .. (chan or '')
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

-- Tenant quotas (docs/SEMANTICS.md, "Tenant quotas"): cfg field quota:<tenant> caps the bytes
-- the leases of that tenant may hold together (nquotas counts such fields); tused:<tenant>
-- counts the bytes its live leases hold (kept for every tenant with leases, deleted at 0).
-- A waiter whose tenant has no room for it is passed over by hand-offs, and so are the later
-- waiters of that tenant (a tenant's own waiters keep their order, so a large request is not
-- starved by its tenant's small ones), looking at most QUOTA_DEPTH waiters deep.
local QUOTA_DEPTH = 32

-- The quota of `tenant` (0: none), the bytes its live leases hold and the bytes its resident
-- leases hold (see "Resident leases" below).
local function tenant_use(tenant)
  local q = redis.call('HMGET', K_CFG, 'quota:' .. tenant, 'tused:' .. tenant, 'tres:' .. tenant)
  return tonumber(q[1] or '0'), tonumber(q[2] or '0'), tonumber(q[3] or '0')
end

-- Add `delta` bytes to the cfg counter `field`, removed when it falls to 0.
local function count_field(field, delta)
  if redis.call('HINCRBY', K_CFG, field, fmt(delta)) <= 0 then
    redis.call('HDEL', K_CFG, field)
  end
end

-- Add `delta` bytes to what `tenant` holds ('' : no tenant, nothing to count).
local function tenant_add(tenant, delta)
  if tenant == nil or tenant == '' then return end
  count_field('tused:' .. tenant, delta)
end

-- Whether a request of `amount` bytes by `tenant` may be granted as far as its quota goes:
-- 'ok', 'wait' (its tenant holds too much now) or 'never' (it exceeds the quota, or, when it
-- is not resident (`res` false), what the tenant's resident leases leave of it). `room`
-- caches tenant -> {quota, used, resident} within one call (quota_take keeps it current).
local function quota_check(room, tenant, amount, res)
  if tenant == '' then return 'ok' end
  local r = room[tenant]
  if not r then
    local q, u, rs = tenant_use(tenant)
    r = {q, u, rs}
    room[tenant] = r
  end
  if r[1] == 0 then return 'ok' end
  if amount > r[1] or (not res and amount > r[1] - r[3]) then return 'never' end
  if r[2] + amount > r[1] then return 'wait' end
  return 'ok'
end

local function quota_take(room, tenant, amount, res)
  local r = room[tenant]
  if r then
    r[2] = r[2] + amount
    if res then r[3] = r[3] + amount end
  end
end

-- Every tenant's quota and use: {tenant -> {quota (0: none), used}} (from the cfg hash, whose
-- size grows with the tenants: status and configure only).
local function tenant_table()
  local out = {}
  local all = redis.call('HGETALL', K_CFG)
  for j = 1, #all, 2 do
    local kind, t = string.match(all[j], '^(%a+):(.+)$')
    if kind == 'quota' or kind == 'tused' then
      local r = out[t]
      if not r then r = {0, 0}; out[t] = r end
      if kind == 'quota' then r[1] = tonumber(all[j + 1]) else r[2] = tonumber(all[j + 1]) end
    end
  end
  return out
end

-- The pool's quotas as configure.lua takes them: "<tenant>=<bytes> ..." sorted by tenant.
local function quota_spec()
  local items = {}
  for t, r in pairs(tenant_table()) do
    if r[1] > 0 then items[#items + 1] = t .. '=' .. fmt(r[1]) end
  end
  table.sort(items)
  return table.concat(items, ' ')
end

-- Devices (docs/SEMANTICS.md, "Devices and placement"): a pool of several devices (2 ..
-- MAX_DEVICES) has cfg fields devices (their count), dcap:<i> and dused:<i> (capacity and bytes
-- its leases hold, per device i = 0 .. devices-1; capacity and used are the sums) and
-- placement. A lease is on one device; a request names one (pins it) or lets the script place
-- it: 'bestfit' takes the device with the least free bytes that fits the request (keeping
-- large holes for large requests), 'spread' the one with the most; ties go to the lowest
-- index. A pool of one device has no devices, dcap or dused field (its leases' device is '',
-- index 0).
local MAX_DEVICES = 64

-- Add `delta` bytes to what device `dev` holds ('' : a pool of one device, nothing to count).
local function device_add(dev, delta)
  if dev == nil or dev == '' then return end
  redis.call('HINCRBY', K_CFG, 'dused:' .. dev, fmt(delta))
end

-- A pool's devices as the scripts use them: {n, rule, cap = {[i] = bytes}, used = {[i] = bytes},
-- res = {[i] = bytes of resident leases}} from cfg fields devices (`n`, as read) and placement
-- (`rule`); nil for a pool of one device.
local function load_devices(n, rule)
  n = tonumber(n or '0')
  if n < 2 then return nil end
  local f = {}
  for i = 0, n - 1 do
    f[#f + 1] = 'dcap:' .. i
    f[#f + 1] = 'dused:' .. i
    f[#f + 1] = 'dres:' .. i
  end
  local v = redis.call('HMGET', K_CFG, unpack(f))
  local d = {n = n, rule = rule or PLACEMENTS[1], cap = {}, used = {}, res = {}}
  for i = 0, n - 1 do
    d.cap[i], d.used[i] = tonumber(v[3 * i + 1] or '0'), tonumber(v[3 * i + 2] or '0')
    d.res[i] = tonumber(v[3 * i + 3] or '0')
  end
  return d
end

-- The most bytes one request pinned to `pin` ('' : any device) could ever get on `d`.
local function device_max(d, pin)
  if pin ~= '' then return d.cap[tonumber(pin)] or 0 end  -- 0: not a device of the pool
  local m = 0
  for i = 0, d.n - 1 do if d.cap[i] > m then m = d.cap[i] end end
  return m
end

-- The device a request of `amount` bytes pinned to `pin` ('' : any) gets now on `d` (by its
-- placement rule), as a number, or nil when none has room. Reads nothing: O(devices).
local function place(d, amount, pin)
  if pin ~= '' then
    local i = tonumber(pin)
    if d.used[i] + amount <= d.cap[i] then return i end
    return nil
  end
  local best, bfree
  local spread = d.rule == 'spread'
  for i = 0, d.n - 1 do
    local free = d.cap[i] - d.used[i]
    if free >= amount and (best == nil or (spread and free > bfree) or (not spread and free < bfree)) then
      best, bfree = i, free
    end
  end
  return best
end

-- Resident leases (docs/SEMANTICS.md, "Resident leases"): a lease acquired as resident (what
-- its holder keeps on the device for its whole life: a model's weights) counts in the cfg
-- fields resident (bytes held by resident leases), dres:<i> (of them, on device i) and
-- tres:<tenant> (of them, the tenant's); a resident request in the queue counts in rqueued.
-- * A request that is not resident and larger than what they leave can never be granted while
--   they are held: acquire refuses it at once (room_refusal: more than capacity - resident -
--   rqueued, than its device's (or the best device's) capacity - dres, than its tenant's quota
--   - tres), and a hand-off drops it from the queue (grant_from, against the resident leases
--   held).
-- * A resident request is granted or queued only when it fits the capacity next to the
--   resident leases held and queued (capacity - resident - rqueued); else acquire answers it
--   "not queued" (code 3), whatever its mode. So the resident requests queued fit together,
--   and none sits at the head of the queue blocking everyone when it cannot fit.
-- Add `delta` bytes of resident leases of `tenant` ('' : none) on device `dev` ('' : one).
local function resident_add(tenant, dev, delta)
  count_field('resident', delta)
  if tenant ~= nil and tenant ~= '' then count_field('tres:' .. tenant, delta) end
  if dev ~= nil and dev ~= '' then count_field('dres:' .. dev, delta) end
end

-- The most bytes a request that is not resident, pinned to `pin` ('' : any), could ever get
-- on `d` next to the resident leases held there; and that device's index.
local function device_room(d, pin)
  local best, bi = nil, nil
  for i = 0, d.n - 1 do
    if pin == '' or i == tonumber(pin) then
      local r = d.cap[i] - d.res[i]
      if best == nil or r > best then best, bi = r, i end
    end
  end
  return best or 0, bi
end

-- The resident counters recounted from the records, and repaired where they disagree: a
-- release or reap by an earlier gpulock version sharing the pool (a rolling upgrade) removes a
-- resident lease or request without lowering them, so they can only overcount, and a request
-- would be refused against a room smaller than it is. Every check that is about to refuse or
-- drop a request because of them calls this first (room_refusal, acquire's resident check,
-- grant_from), and decides again on what it returns: {held, queued, dev = {[i] = bytes},
-- tenant = {[t] = bytes}, fixed = whether a counter was written}. Reads every holder and
-- waiter record and the cfg hash: O(holders + waiters + cfg fields), on refusals only. An
-- expired lease not reaped yet still counts (its reap lowers the counters by its record).
local function resident_recount()
  local x = {held = 0, queued = 0, dev = {}, tenant = {}, fixed = false}
  local want = {}  -- counter field -> bytes
  local hs = redis.call('HGETALL', K_HOLDERS)
  for j = 2, #hs, 2 do
    local a, _, _, _, _, _, tn, dv, res = parse_holder(hs[j])
    if res then
      x.held = x.held + a
      if dv ~= '' then
        local i = tonumber(dv)
        x.dev[i] = (x.dev[i] or 0) + a
        want['dres:' .. dv] = x.dev[i]
      end
      if tn ~= '' then
        x.tenant[tn] = (x.tenant[tn] or 0) + a
        want['tres:' .. tn] = x.tenant[tn]
      end
    end
  end
  if redis.call('ZCARD', K_QUEUE) > 0 then  -- an empty queue has no waiters (acquire.lua)
    local ws = redis.call('HGETALL', K_WAITERS)
    for j = 2, #ws, 2 do
      local a, _, _, _, _, _, _, _, _, res = parse_waiter(ws[j])
      if res then x.queued = x.queued + a end
    end
  end
  want.resident, want.rqueued = x.held, x.queued
  local all = redis.call('HGETALL', K_CFG)
  for j = 1, #all, 2 do
    local f = all[j]
    if f == 'resident' or f == 'rqueued' or string.match(f, '^[dt]res:') then
      local v = want[f] or 0
      if tonumber(all[j + 1]) ~= v then
        x.fixed = true
        if v > 0 then redis.call('HSET', K_CFG, f, fmt(v)) else redis.call('HDEL', K_CFG, f) end
      end
      want[f] = nil
    end
  end
  for f, v in pairs(want) do  -- counters missing where records are (undercounted)
    if v > 0 then
      x.fixed = true
      redis.call('HSET', K_CFG, f, fmt(v))
    end
  end
  return x
end

-- Put a recount's device and tenant totals into `d` (load_devices; nil: one device) and
-- `room` (quota_check's cache).
local function resident_apply(x, d, room)
  if d then for i = 0, d.n - 1 do d.res[i] = x.dev[i] or 0 end end
  for t, r in pairs(room) do r[3] = x.tenant[t] or 0 end
end

-- Take a waiter out of the queue. `rbytes`: its bytes when it is a resident request (taken
-- from rqueued), 0 when not; `grow`: whether it is the growth of a lease (taken from
-- gqueued, see "Leases that wait to grow" below); rbytes nil: both read from its record.
local function drop_waiter(ticket, rbytes, grow)
  if rbytes == nil then
    rbytes = 0
    local rec = redis.call('HGET', K_WAITERS, ticket)
    if rec then
      local a, _, _, _, _, _, _, _, _, res, g = parse_waiter(rec)
      if res then rbytes = a end
      grow = g
    end
  end
  if rbytes > 0 then count_field('rqueued', -rbytes) end
  if grow then count_field('gqueued', -1) end
  redis.call('ZREM', K_QUEUE, ticket)
  redis.call('HDEL', K_WAITERS, ticket)
  redis.call('ZREM', K_WEXP, ticket)
end

-- A lease asked to yield is gone: count it as yielded (`released`: its holder let it go) with
-- the time from the ask, or as taken back (it expired). `y`: its yield_field value (nil: it
-- was never asked, nothing to count). Counters in cfg: y_done, y_done_ms, y_taken.
local function yield_gone(y, released, now)
  if not y then return end
  if released then
    local asked = tonumber(string.match(y, '^(%d+)|')) or now
    redis.call('HINCRBY', K_CFG, 'y_done', 1)
    redis.call('HINCRBY', K_CFG, 'y_done_ms', fmt(math.max(0, now - asked)))
  else
    redis.call('HINCRBY', K_CFG, 'y_taken', 1)
  end
end

-- Kept bytes (docs/SEMANTICS.md, "Kept bytes"): a lease whose holder released it while nobody
-- waited, and which the holder's pool object keeps to grant its own next request from without
-- a round trip (release.lua's 'keep' mode). It stays an ordinary lease here (renewed, reaped,
-- released as any); the pool's cfg field `kept` lists such leases with their holder's channel,
-- " <lease_id>|<channel> <lease_id>|<channel> ...", so that a request that does not fit can
-- tell each holder to give them back (tell_kept). The list is short (a process keeps at most
-- the leases it had in use at once) and goes with each lease (kept_drop in drop_lease and
-- release.lua).
local function kept_has(list, lid)
  return list and string.find(list, ' ' .. lid .. '|', 1, true) ~= nil or false
end

-- `list` (cfg kept as read, or nil) without lease `lid`, written back (the field is deleted
-- when nothing is left). Does nothing when `lid` is not in it.
local function kept_drop(list, lid)
  if not list then return end
  local s = string.find(list, ' ' .. lid .. '|', 1, true)
  if not s then return end
  local e = string.find(list, ' ', s + 1, true)
  local rest = string.sub(list, 1, s - 1) .. (e and string.sub(list, e) or '')
  if rest == '' then redis.call('HDEL', K_CFG, 'kept') else redis.call('HSET', K_CFG, 'kept', rest) end
end

-- Remove one lease (by id) and return its bytes to the pool: `released` when its holder gave
-- it up (cancel.lua), not when it expired (reap). Returns true if it existed.
local function drop_lease(lid, released)
  local rec = redis.call('HGET', K_HOLDERS, lid)
  redis.call('ZREM', K_LEASES, lid)
  if not rec then return false end
  local amount, _, _, _, ticket, _, tenant, dev, res = parse_holder(rec)
  redis.call('HDEL', K_HOLDERS, lid)
  local y = redis.call('HGET', K_TICKETS, yield_field(lid))
  if y then yield_gone(y, released, now_ms()) end
  if ticket and ticket ~= '' then
    redis.call('HDEL', K_TICKETS, ticket, place_field(lid), pre_field(lid), yield_field(lid))
  else
    redis.call('HDEL', K_TICKETS, place_field(lid), pre_field(lid), yield_field(lid))
  end
  redis.call('HINCRBY', K_CFG, 'used', fmt(-amount))
  tenant_add(tenant, -amount)
  device_add(dev, -amount)
  if res then resident_add(tenant, dev, -amount) end
  if not res then kept_drop(redis.call('HGET', K_CFG, 'kept'), lid) end
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

-- What the reap of expired leases `dead` and gone waiters `gone` will free of the resident
-- leases: {held, queued, dev = {[i] = bytes}, tenant = bytes of `tenant`'s}. Reads only.
local function resident_freed(dead, gone, tenant)
  local f = {held = 0, queued = 0, dev = {}, tenant = 0}
  for _, lid in ipairs(dead) do
    local rec = redis.call('HGET', K_HOLDERS, lid)
    if rec then
      local a, _, _, _, _, _, tn, dv, res = parse_holder(rec)
      if res then
        f.held = f.held + a
        if dv ~= '' then f.dev[tonumber(dv)] = (f.dev[tonumber(dv)] or 0) + a end
        if tn == tenant then f.tenant = f.tenant + a end
      end
    end
  end
  for _, t in ipairs(gone) do
    local rec = redis.call('HGET', K_WAITERS, t)
    if rec then
      local a, _, _, _, _, _, _, _, _, res = parse_waiter(rec)
      if res then f.queued = f.queued + a end
    end
  end
  return f
end

-- room_check: room_refusal's checks against `rsv`, the resident bytes held and queued (reads
-- only).
local function room_check(amount, tenant, pin, cap, rsv, d, quotas, room, dead, gone)
  local reaping = #dead + #gone > 0
  local f  -- resident_freed, read only when a check fails while something is to be reaped
  if amount > cap - rsv and reaping then
    f = resident_freed(dead, gone, tenant)
    rsv = rsv - f.held - f.queued
  end
  if amount > cap - rsv then
    return redis.error_reply('GPULOCK_ROOM ' .. fmt(amount) .. ' ' .. fmt(cap - rsv) .. ' ' .. fmt(cap)
                             .. ' ' .. fmt(rsv))
  end
  if d then
    local best, i = device_room(d, pin)
    if amount > best and reaping then
      f = f or resident_freed(dead, gone, tenant)
      for j, b in pairs(f.dev) do d.res[j] = d.res[j] - b end
      best, i = device_room(d, pin)
      for j, b in pairs(f.dev) do d.res[j] = d.res[j] + b end
    end
    if amount > best then
      return redis.error_reply('GPULOCK_ROOM ' .. fmt(amount) .. ' ' .. fmt(best) .. ' ' .. fmt(d.cap[i])
                               .. ' ' .. fmt(d.cap[i] - best) .. ' device ' .. (pin ~= '' and pin or 'any'))
    end
  end
  if quotas and tenant ~= '' then
    local t = room[tenant]
    if not t then t = {tenant_use(tenant)} end
    local q, r = t[1], t[3]
    if q > 0 and amount > q - r and reaping then
      f = f or resident_freed(dead, gone, tenant)
      r = r - f.tenant
    end
    if q > 0 and amount > q - r then
      return redis.error_reply('GPULOCK_QUOTA ' .. fmt(amount) .. ' ' .. fmt(q) .. ' ' .. tenant .. ' ' .. fmt(r))
    end
  end
  return nil
end

-- acquire's refusal of a request that is not resident and can never be granted next to the
-- resident leases (see "Resident leases" above), as an error reply, or nil:
--   GPULOCK_ROOM <amount> <room> <capacity> <resident>   the pool: room = capacity - resident,
--                                     resident = bytes of the resident leases held and queued
--   GPULOCK_ROOM ... device <i|any>   a device of a pool of several: its capacity and resident
--                                     leases (for 'any', of the device with the most room)
--   GPULOCK_QUOTA <amount> <quota> <tenant> <resident>   the tenant's quota and its resident
-- `held`, `queued`: cfg resident and rqueued as read; `d`: load_devices (nil: one device);
-- `pin`: '' or the device index; `quotas`: whether the pool has any; `room`: quota_check's
-- cache, where acquire's quota check put the tenant's numbers. Counted as they will be
-- once the expired leases `dead` and the gone waiters `gone` are reaped (their records are
-- read only when a check fails). Before it refuses, it recounts the resident leases from the
-- records (resident_recount, which repairs counters that disagree: its only writes) and
-- refuses only if the exact totals still say so.
local function room_refusal(amount, tenant, pin, cap, held, queued, d, quotas, room, dead, gone)
  local err = room_check(amount, tenant, pin, cap, held + queued, d, quotas, room, dead, gone)
  if not err then return nil end
  local x = resident_recount()
  if not x.fixed then return err end
  resident_apply(x, d, room)
  return room_check(amount, tenant, pin, cap, x.held + x.queued, d, quotas, room, dead, gone)
end

-- A holder record (see KEYS above); dev: '' or a device index (string or number); res: a
-- resident lease.
local function holder_record(amount, token, now, ttl, ticket, tenant, meta, dev, res)
  return fmt(amount) .. '|' .. fmt(token) .. '|' .. fmt(now) .. '|' .. fmt(ttl) .. '|' .. ticket
    .. '|' .. tenant .. '|' .. dev .. (res and 'r' or '') .. '|' .. meta
end

-- Make a lease with fencing token ``token`` on device ``dev`` ('' on a pool of one device),
-- resident when ``res``, and count it to its tenant and device (the caller takes the token
-- from the pool's fence and writes the pool's counters: fence, used, grants). Returns its
-- expiry. `pre`: its preemption field (see "Preemption"; nil: it is never asked to yield).
local function make_lease(now, ticket, lid, amount, ttl, meta, token, tenant, dev, res, pre)
  local exp = now + ttl
  redis.call('ZADD', K_LEASES, fmt(exp), lid)
  redis.call('HSET', K_HOLDERS, lid, holder_record(amount, token, now, ttl, ticket, tenant, meta, dev, res))
  if pre then
    redis.call('HSET', K_TICKETS, ticket, lid, pre_field(lid), pre)
  else
    redis.call('HSET', K_TICKETS, ticket, lid)
  end
  tenant_add(tenant, amount)
  device_add(dev, amount)
  if res then resident_add(tenant, dev, amount) end
  return exp
end

-- Resizing (docs/SEMANTICS.md, "Resizing a lease"; resize.lua): lease `lid` grows by `delta`
-- bytes, or shrinks when `delta` is negative: its record's amount, and its tenant's and
-- device's counts (the caller writes the pool's `used`). Keeps its id, token, ttl and expiry.
-- Returns its token, its expiry and its new amount.
local function grow_lease(lid, delta)
  local rec = redis.call('HGET', K_HOLDERS, lid)
  local a, tok, acq, ttl, ticket, meta, tenant, dev, res = parse_holder(rec)
  redis.call('HSET', K_HOLDERS, lid, holder_record(a + delta, tonumber(tok), tonumber(acq), tonumber(ttl),
                                                  ticket, tenant, meta, dev, res))
  tenant_add(tenant, delta)
  device_add(dev, delta)
  if res then resident_add(tenant, dev, delta) end
  return tonumber(tok), tonumber(redis.call('ZSCORE', K_LEASES, lid)), a + delta
end

-- The amount lease `lid` would have after growing by `delta` (a growth waiter's), or nil when
-- it can never grow: the lease is gone (released, expired), or the new amount exceeds its
-- tenant's quota (quota_check 'never'; `room` its cache).
local function grown_total(lid, delta, tenant, room)
  local rec = redis.call('HGET', K_HOLDERS, lid)
  if not rec then return nil end
  local total = parse_holder(rec) + delta
  if quota_check(room, tenant, total, false) == 'never' then return nil end
  return total
end

-- Leases that wait to grow (docs/SEMANTICS.md, "Resizing a lease"). cfg field gqueued counts
-- the growth waiters queued (resize.lua adds one, drop_waiter takes it away); it only gates
-- the scan below, so a count that is too high costs a scan and changes no decision. A lease
-- *may free bytes* when it holds some, is not resident and does not wait to grow itself (no
-- waiter grow_ticket(id)): its holder releases it or it expires. A device none of whose
-- leases may free bytes is *stuck*: every byte on it is held by a resident lease or by a
-- lease that waits to grow, so nothing frees bytes there until a growth is granted (or times
-- out). growth_scan reads the holder records and, for each lease on a device not yet known
-- to have one that may free bytes, whether it waits to grow; `except`: a lease id not to
-- count (nil: none); `only`: the one device that matters (nil: every device of the `ndev`).
-- It stops once each device that matters has a lease that may free bytes, so the usual case
-- reads one HEXISTS per device. Returns frees = {[dev] = true} for the devices with such a
-- lease (dev as the records write it: '' on a pool of one device, else the index), and
-- growing = {[dev] = {lease ids that wait to grow}} (complete when some device is stuck).
local function growth_scan(ndev, except, only)
  local frees, growing, left = {}, {}, ndev
  if only then left = 1 end
  local hs = redis.call('HGETALL', K_HOLDERS)
  for j = 1, #hs, 2 do
    local l = hs[j]
    if l ~= except then
      local a, _, _, _, _, _, _, dv, rs = parse_holder(hs[j + 1])
      if a > 0 and not rs and not frees[dv] and (only == nil or dv == only) then
        if redis.call('HEXISTS', K_WAITERS, grow_ticket(l)) == 1 then
          local g = growing[dv]
          if not g then g = {}; growing[dv] = g end
          g[#g + 1] = l
        else
          frees[dv] = true
          left = left - 1
          if left <= 0 then break end
        end
      end
    end
  end
  return frees, growing
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
local MIN_BACKFILL_MS, MAX_BACKFILL_MS = 1, 86400000  -- a pool's backfill_ms
local function backfill_open(now, head_enq_ms)
  local bf = redis.call('HMGET', K_CFG, 'policy', 'backfill_ms')
  return bf[1] == 'backfill' and now - tonumber(head_enq_ms) < tonumber(bf[2] or DEFAULT_BACKFILL_MS)
end

-- Drain rate (docs/SEMANTICS.md, "Wait estimate"): how fast the queue drains while it is busy,
-- the rate a waiter's estimate (gpulock/estimates/wait.py) divides by. Updated only where a
-- queued waiter is granted (grant_from: hand-offs, growths included; never the uncontended
-- grant of acquire.lua, which says nothing about a queue), in the cfg fields read and written
-- with the hand-off's own counters (no extra call): dr_b, dr_g, dr_t are the decayed bytes
-- granted, grants and busy ms, dr_at the server ms of the last such grant. A grant of b bytes
-- at `now` to a waiter enqueued at enq_ms counts dt = now - max(dr_at, min(enq_ms, dr_q)) ms
-- of busy time, dr_q being when the queue last went from empty to not empty (set by the
-- scripts that queue: the queue had a waiter since then, also one that gave up or was reaped
-- meanwhile; without it, time in which earlier waiters queued and left before this grant was
-- lost and the rate read too fast; grants made together count 0 after the first) and decays the past by w = exp(-dt / DRAIN_TAU_MS): dr_b = dr_b*w + b, dr_g =
-- dr_g*w + 1, dr_t = dr_t*w + dt. Idle time (no waiter) does not decay it: a pool quiet for an
-- hour still knows how fast its last queue drained. A pool created again (Redis lost its data,
-- FLUSHALL) starts without the fields: unmeasured; its grace period (nothing granted) counts
-- no busy time either: a grant after it counts from max(dr_at, min(enq_ms, dr_q), grace_until).
-- DRAIN_TAU_MS: 30 s of busy time, the time constant: long enough to smooth the release
-- pattern of a few holders (one grant per release), short enough that a change of workload
-- shows within a minute of queueing. DRAIN_MIN_MS: the busy time below which the rate is not
-- reported (a first grant after a few ms of queueing would claim an absurd rate).
local DRAIN_TAU_MS, DRAIN_MIN_MS = 30000, 200
-- dr_o: the decayed count of those grants that went out of queue-arrival order (a later
-- arrival granted while an earlier one still waits: a priority, backfill, a tenant's quota,
-- a growth at its lease's place), so dr_o / dr_g is the share of the queue's grants that
-- passed someone (grant_from marks them; `ooo` true here, or passed_mark() after the fact).
local function drain_step(dr, now, enq, b, ooo)
  local at = math.max(dr.at, tonumber(enq) or 0)
  local dt = math.max(0, now - at)
  local w = math.exp(-dt / DRAIN_TAU_MS)
  dr.b, dr.g, dr.t, dr.at = dr.b * w + b, dr.g * w + 1, dr.t * w + dt, now
  dr.o = dr.o * w + (ooo and 1 or 0)
end
local function drain_fields(dr)
  local f = function(x) return string.format('%.17g', x) end
  return 'dr_b', f(dr.b), 'dr_g', f(dr.g), 'dr_t', f(dr.t), 'dr_at', fmt(dr.at), 'dr_o', f(dr.o)
end
-- The rate as replies carry it (integers, as Lua numbers reach Redis truncated):
-- bytes_per_s (bytes per second of busy time), grants_per_ks (grants per 1000 s of busy
-- time), each at least 1 when measured, and out_of_order_pm (per mille of the grants that
-- went out of arrival order, dr_o / dr_g); 0, 0, 0 while unmeasured (busy time under
-- DRAIN_MIN_MS).
local function drain_rate()
  local r = redis.call('HMGET', K_CFG, 'dr_b', 'dr_g', 'dr_t', 'dr_o')
  local b, g, t = tonumber(r[1] or '0') or 0, tonumber(r[2] or '0') or 0, tonumber(r[3] or '0') or 0
  if t < DRAIN_MIN_MS or b <= 0 or g <= 0 then return 0, 0, 0 end
  local o = math.min(g, math.max(0, tonumber(r[4] or '0') or 0))
  return math.max(1, math.floor(b / t * 1000)), math.max(1, math.floor(g / t * 1000000)),
         math.floor(o / g * 1000)
end

-- Bytes ahead of a waiter (docs/SEMANTICS.md, "Wait estimate"), the one place they are
-- counted: acquire's and resize's replies (not_granted), renew's and status's per waiter.
-- ahead_walk(now, n) reads the first min(n, AHEAD_DEPTH) waiters in queue order (one ZRANGE,
-- one HMGET; a growth counts the bytes it grows by) and what decides which of them are ahead
-- of whom; ahead_of(w, m, amount, tenant) is then the bytes and the count of those of the
-- first m waiters that are ahead of a waiter of `amount` bytes and `tenant` ('' : none):
-- * every one of them, in queue order (FIFO), except
-- * under the backfill policy while the head's window is open (backfill_open), those larger
--   than `amount`: it fits before them and passes them;
-- * on a pool with tenant quotas, those whose tenant is at its quota (quota_check 'wait', and
--   every later waiter of that tenant, as grant_from passes them) and is not `tenant`: they
--   wait for their own tenant's releases, and the others pass them.
-- Beyond the walked part, the walked part's share stands in for each one (its bytes and its
-- count scaled by m / walked), so the result is exact for the first AHEAD_DEPTH + 1 places and
-- an extrapolation behind them. The depth keeps a queued acquire's reply O(1) (every acquire
-- that queues pays it): a walk of 1000 tripled the time 3000 waiters took to queue. Cost of
-- ahead_of: O(1) from prefix sums when no waiter is passed; else at most AHEAD_DEPTH steps, and
-- once per (amount, tenant) for places beyond the walk (memo), so status's walk over `limit`
-- waiters stays linear.
local AHEAD_DEPTH = 32
local function waiter_amount(rec)  -- a waiter record's amount (parse_waiter's first field), 0 if none
  return rec and tonumber(string.match(rec, '^(%d+)|')) or 0
end
local function ahead_walk(now, n)
  local w = {k = 0, sum = {[0] = 0}, amt = {}, ten = {}, blk = {}, bf = false, any = false, memo = {}}
  local k = math.min(n, AHEAD_DEPTH)
  if k <= 0 then return w end
  local ts = redis.call('ZRANGE', K_QUEUE, 0, k - 1)
  if #ts == 0 then return w end
  local recs = redis.call('HMGET', K_WAITERS, unpack(ts))
  local c = redis.call('HMGET', K_CFG, 'policy', 'backfill_ms', 'nquotas')
  local quotas = c[3] ~= false and c[3] ~= '0'
  local room, atq = {}, {}
  local plain = c[1] ~= 'backfill' and not quotas  -- FIFO without quotas: the amounts only
  for i = 1, #ts do
    local rec, a, tenant = recs[i], 0, ''
    if plain then
      a = waiter_amount(rec)
    elseif rec then
      local amount, _, enq, _, _, _, _, t, _, res = parse_waiter(rec)
      a, tenant = amount or 0, t or ''
      if i == 1 and c[1] == 'backfill' then
        w.bf = now - (tonumber(enq) or now) < tonumber(c[2] or DEFAULT_BACKFILL_MS)
      end
      if quotas and tenant ~= '' and (atq[tenant] or quota_check(room, tenant, a, res) == 'wait') then
        atq[tenant], w.blk[i], w.any = true, true, true
      end
    end
    w.amt[i], w.ten[i], w.sum[i] = a, tenant, w.sum[i - 1] + a
  end
  w.k = #ts
  if w.bf then w.any = true end
  return w
end
local function ahead_of(w, m, amount, tenant)
  if m <= 0 or w.k == 0 then return 0, 0 end
  local upto = math.min(m, w.k)
  local b, n
  if not w.any then
    b, n = w.sum[upto], upto
  else
    local key = upto == w.k and (fmt(amount) .. '|' .. (tenant or ''))
    local hit = key and w.memo[key]
    if hit then
      b, n = hit[1], hit[2]
    else
      b, n = 0, 0
      for i = 1, upto do
        if not (w.blk[i] and w.ten[i] ~= tenant) and not (w.bf and w.amt[i] > amount) then
          b, n = b + w.amt[i], n + 1
        end
      end
      if key then w.memo[key] = {b, n} end
    end
  end
  if m > w.k then return math.floor(b / w.k * m), math.floor(n / w.k * m) end
  return b, n
end
-- What a waiter's estimate needs beyond the reply's capacity, used and held_back: of the
-- waiter at 1-based `pos` (0: a request not queued, so every queued waiter is before it) of
-- `amount` bytes and `tenant`, the bytes and the count of the waiters ahead (ahead_of), its
-- amount, and drain_rate()'s three integers.
local function wait_inputs(now, pos, amount, tenant)
  local m = pos
  if pos <= 0 then m = redis.call('ZCARD', K_QUEUE) else m = pos - 1 end
  local b, g, o = drain_rate()
  local ahead, count = ahead_of(ahead_walk(now, m), m, amount, tenant or '')
  return ahead, amount, b, g, count, o
end

-- Server-side hand-off: grant the longest prefix of the queue (in queue order: lib.lua
-- queue_score; a growth at its lease's place, lease_place) that fits, strictly in order (a head that does not fit blocks those behind it,
-- so none starves), then, under the backfill policy, later requests that fit (backfill_open).
-- With tenant quotas, a waiter whose tenant has no room for it (quota_check 'wait') is passed
-- over and does not block those behind it: the head is then the first waiter whose tenant has
-- room, looking at most QUOTA_DEPTH waiters deep (queue_front).
-- On a pool of several devices a request fits when the pool's bytes fit it and a device has
-- room for it (place: its pinned device, or one the placement rule picks).
-- Then, when waiters are left, the growths of leases on a stuck device that fit (growth_scan;
-- docs/SEMANTICS.md, "Resizing a lease"): the one rule that keeps a queue that cannot move
-- from stalling the leases that wait to grow.
-- Returns the grant lines grouped by the waiters' channels, and their count, for publish(),
-- then whether waiter `own` (the caller's own ticket, or nil) was granted: its grant is
-- counted but not published (the caller answers it).
-- grant_from: the same with what the caller read already: the queue's head (ZRANGE 0 0), the
-- capacity, bytes used, grace_until, the effective capacity (eff_cap), the devices
-- (load_devices; nil for one device, kept current here), the bytes of the resident leases
-- held (cfg resident) and `own`; it returns the bytes used afterwards before whether `own`
-- was granted. A request that can never be
-- granted is dropped: larger than the capacity (of its device, or of the largest), than its
-- tenant's quota, or than what the resident leases held leave of them (see "Resident
-- leases"; before the first such drop the resident counters are recounted from the records,
-- resident_recount); one that fits the capacity but not the effective capacity, or no device
-- now, waits.
local function grant_from(now, head, cap, used, grace_until, eff, d, rh, own)
  local lines, n, own_granted = {}, 0, false
  if #head == 0 then return lines, n, used, own_granted end
  if grace_until > now then return lines, n, used, own_granted end  -- no new grant in the grace period
  local fence, grants  -- read at the first grant; the counters are written once, at the end
  local dr  -- the drain rate's fields (see "Drain rate"), read and written with them
  local room = {}  -- quota_check's cache (a waiter without a tenant costs no read)
  local passed = {}  -- tenants with a waiter passed over: their later waiters are passed too
  -- Grant waiter `t` (record fields parsed) a lease now, on device `dev` ('' : one device).
  -- A growth (`grow`) adds `amount` to lease `lid` instead (grow_lease): the line then names
  -- the lease's token, expiry and new amount.
  -- `ooo`: it goes out of arrival order (see "Drain rate"; the main pass's grants are marked
  -- after the fact, by last_enq).
  local last_enq  -- the enqueue ms of the main pass's last grant counted in the drain rate
  -- `prio`, `keep`: the waiter's priority, and whether its lease may never be asked to yield.
  local function grant(t, amount, ttl, lid, chan, meta, tenant, dev, res, grow, enq, ooo, prio, keep)
    if not fence then
      local c = redis.call('HMGET', K_CFG, 'fence', 'grants', 'dr_b', 'dr_g', 'dr_t', 'dr_at', 'dr_o', 'dr_q')
      fence, grants = tonumber(c[1] or '0'), tonumber(c[2] or '0')
      dr = {b = tonumber(c[3] or '0') or 0, g = tonumber(c[4] or '0') or 0,
            t = tonumber(c[5] or '0') or 0, at = tonumber(c[6] or '0') or 0, o = tonumber(c[7] or '0') or 0,
            q = tonumber(c[8] or '')}
    end
    last_enq = nil
    -- own: queued by this very call; a grace period that ended is no busy time (the waiter
    -- waited for its end, not for the queue to drain)
    if t ~= own then
      local since = tonumber(enq) or 0
      if dr.q and dr.q < since then since = dr.q end  -- the queue was busy since dr_q
      drain_step(dr, now, math.max(since, grace_until), amount, ooo)
      if not ooo then last_enq = tonumber(enq) end
    end
    local wscore = not grow and redis.call('ZSCORE', K_QUEUE, t)  -- the lease's place (lease_place)
    drop_waiter(t, res and amount or 0, grow)
    local tok, exp, total
    if grow then
      tok, exp, total = grow_lease(lid, amount)
    else
      fence = fence + 1
      tok, total = fence, amount
      exp = make_lease(now, t, lid, amount, ttl, meta, fence, tenant, dev, res, pre_value(prio, chan, res, keep))
      if wscore then redis.call('HSET', K_TICKETS, place_field(lid), fmt(tonumber(wscore))) end
      grants = grants + 1
    end
    quota_take(room, tenant, amount, res)
    used = used + amount
    n = n + 1
    if res then rh = rh + amount end
    local line = t .. ' ' .. lid .. ' ' .. fmt(tok) .. ' ' .. fmt(exp) .. ' ' .. fmt(total)
    if dev ~= '' then
      d.used[dev] = d.used[dev] + amount
      if res then d.res[dev] = d.res[dev] + amount end
      line = line .. ' ' .. fmt(dev)
    end
    if t == own then  -- the caller's own request: it answers in its reply, not by a message
      own_granted = true
      return
    end
    local group = lines[chan]
    if not group then group = {}; lines[chan] = group end
    group[#group + 1] = line
  end
  -- The device waiter `amount`/`pin` gets now ('' on one device), or nil when none has room.
  local function where(amount, pin)
    if not d then return '' end
    return place(d, amount, pin)
  end
  -- Whether waiter `amount`/`pin`/`res` can never be granted next to the resident leases held.
  local function crowded(amount, pin, res)
    if amount > cap - rh then return true end  -- for a resident one: the others' leave too little
    return not res and d ~= nil and amount > device_room(d, pin)
  end
  local function largest(pin)
    if not d then return cap end
    return device_max(d, pin)
  end
  -- Whether waiter `amount`/`pin`/`res` (quota_check `q`) can never be granted.
  local function never(amount, pin, res, q)
    return amount > largest(pin) or q == 'never' or crowded(amount, pin, res)
  end
  -- Before the first drop, the resident counters are recounted from the records (once a call,
  -- resident_recount); true when that changed them, and so the decision.
  local recounted = false
  local function recount()
    if recounted then return false end
    recounted = true
    local x = resident_recount()
    if not x.fixed then return false end
    rh = x.held
    resident_apply(x, d, room)
    return true
  end
  local blocked_enq  -- the enqueue time of a head that does not fit
  local skipped = 0  -- waiters passed over at the front: their tenants have no room
  while true do
    if #head == 0 then break end
    local t = head[1]
    local w = redis.call('HGET', K_WAITERS, t)
    if not w then
      drop_waiter(t, 0)
    else
      local amount, ttl, enq, lid, chan, meta, prio, tenant, pin, res, grow, keep = parse_waiter(w)
      -- the grant just made passed this waiter, which arrived earlier (a priority, a growth)
      if last_enq and tonumber(enq) < last_enq then dr.o = dr.o + 1 end
      last_enq = nil
      local q = quota_check(room, tenant, amount, res)
      local dev
      -- a growth can never be granted when its lease's new total could not be (the lease is
      -- gone: it was released or expired)
      local whole = amount
      if grow then whole = grown_total(lid, amount, tenant, room) end
      if whole ~= nil and never(whole, pin, res, q) and recount() then
        q = quota_check(room, tenant, amount, res)
      end
      if whole == nil or never(whole, pin, res, q) then
        -- The capacity (or the tenant's quota) was lowered below this request, or resident
        -- leases took the room it needs: it can never be granted, and as head it would block
        -- everyone behind it. Drop it; its client finds it gone at its next poll, asks again
        -- and gets GPULOCK_CAPACITY (GPULOCK_QUOTA, GPULOCK_ROOM; a resident one: not queued).
        drop_waiter(t, res and amount or 0, grow)
      elseif q == 'wait' or passed[tenant] then
        passed[tenant] = true
        skipped = skipped + 1
        if skipped >= QUOTA_DEPTH then break end
      else
        if used + amount <= eff then dev = where(amount, pin) end
        if dev == nil then
          blocked_enq = enq
          break
        end
        grant(t, amount, ttl, lid, chan, meta, tenant, dev, res, grow, enq, skipped > 0, prio, keep)
      end
    end
    head = redis.call('ZRANGE', K_QUEUE, skipped, skipped)
  end
  if blocked_enq and used < eff and backfill_open(now, blocked_enq) then
    for _, t in ipairs(redis.call('ZRANGE', K_QUEUE, skipped + 1, skipped + BACKFILL_DEPTH)) do
      local w = redis.call('HGET', K_WAITERS, t)
      if w then
        local amount, ttl, enq, lid, chan, meta, prio, tenant, pin, res, grow, keep = parse_waiter(w)
        local q = quota_check(room, tenant, amount, res)
        if q == 'wait' then passed[tenant] = true end
        local whole = amount
        if grow then whole = grown_total(lid, amount, tenant, room) end
        if whole ~= nil and whole <= largest(pin) and used + amount <= eff and q == 'ok' and not passed[tenant] then
          local dev = where(amount, pin)
          if dev ~= nil then grant(t, amount, ttl, lid, chan, meta, tenant, dev, res, grow, enq, true, prio, keep) end
        end
      end
      if used >= eff then break end
    end
  end
  -- Growths ahead of a queue that cannot move (docs/SEMANTICS.md, "Resizing a lease"): where
  -- waiters are left and a device is stuck (growth_scan: every lease holding bytes on it is
  -- resident or waits to grow), nothing will free bytes on that device until a growth there
  -- is granted; so each of its growths that fits now is granted, in queue order, ahead of the
  -- waiters that cannot be (a growth that does not fit does not block the later ones: they
  -- might wait for each other's bytes). Each is checked as the pass above checks it: the
  -- effective capacity, its device, its tenant's quota, what the resident leases leave.
  if (blocked_enq or skipped > 0) and cfg_num('gqueued') > 0 then
    local frees, growing = growth_scan(d and d.n or 1, nil, nil)
    local cands = {}
    for dv, lids in pairs(growing) do
      if not frees[dv] then
        for _, l in ipairs(lids) do
          local s = redis.call('ZSCORE', K_QUEUE, grow_ticket(l))
          if s then cands[#cands + 1] = {tonumber(s), grow_ticket(l)} end
        end
      end
    end
    table.sort(cands, function(x, y) return x[1] < y[1] end)
    for _, c in ipairs(cands) do
      local w = redis.call('HGET', K_WAITERS, c[2])
      if w then
        local amount, ttl, enq, lid, chan, meta, prio, tenant, pin, res, grow, keep = parse_waiter(w)
        local q = quota_check(room, tenant, amount, res)
        local whole
        if grow then whole = grown_total(lid, amount, tenant, room) end
        if whole ~= nil and q == 'ok' and not never(whole, pin, res, q) and used + amount <= eff then
          local dev = where(amount, pin)
          if dev ~= nil then grant(c[2], amount, ttl, lid, chan, meta, tenant, dev, res, grow, enq, true, prio, keep) end
        end
      end
    end
  end
  if n > 0 then
    redis.call('HSET', K_CFG, 'fence', fmt(fence), 'used', fmt(used), 'grants', fmt(grants), drain_fields(dr))
  end
  return lines, n, used, own_granted
end

-- The queue's front as the next hand-off sees it: the first waiter (in queue order) that is
-- not passed over (grant_from), and its score, looking at most QUOTA_DEPTH deep (nil when
-- every waiter looked at is passed over, or the queue is empty); and the tenants passed over
-- before it, each with the score of its first waiter passed over. Without quotas (`quotas`
-- false) the front is the head, found without reading its record. `room`: quota_check's cache.
local function queue_front(quotas, room)
  local passed = {}
  if not quotas then
    local head = redis.call('ZRANGE', K_QUEUE, 0, 0, 'WITHSCORES')
    if #head == 0 then return nil, nil, passed end
    return head[1], tonumber(head[2]), passed
  end
  local ts = redis.call('ZRANGE', K_QUEUE, 0, QUOTA_DEPTH - 1, 'WITHSCORES')
  for j = 1, #ts, 2 do
    local w = redis.call('HGET', K_WAITERS, ts[j])
    if w then
      local amount, _, _, _, _, _, _, tenant, _, res = parse_waiter(w)
      local q = quota_check(room, tenant, amount, res)
      if q == 'ok' and not passed[tenant] then return ts[j], tonumber(ts[j + 1]), passed end
      if q ~= 'never' and not passed[tenant] then passed[tenant] = tonumber(ts[j + 1]) end
    end
  end
  return nil, nil, passed
end

-- Whether a request of `amount` bytes at priority `prio` by `tenant` ('' : none), pinned to
-- `pin` ('' : any), resident when `res`, is granted now rather than queued (docs/SEMANTICS.md,
-- "Priorities", "Backfill", "Tenant quotas"): it fits (the effective capacity `eff` next to
-- `used`, outside a grace period ending at `grace_until`, its tenant's quota, a device of `d`,
-- load_devices or nil) and the queue of `qlen` waiters is empty, or it would queue ahead of
-- the queue's front (queue_front; the head does not fit, as every script that frees bytes
-- hands them on), or, under the backfill policy, the front's window is open. A tenant's own
-- waiters keep their order. `quotas`: whether the pool has any; `room`: quota_check's cache.
-- acquire.lua and resize.lua (a growth, by its difference) decide by it. `gscore`: the
-- growth's queue score, its lease's place (lease_place); nil for a new request, whose score
-- is queue_score's. Returns whether it is granted now, the device it gets ('' on a pool of
-- one device), and, with a queue, its queue score and, for a new request, its arrival
-- (queue_score).
local function grant_test(now, amount, prio, tenant, pin, res, used, eff, grace_until, qlen, d, quotas, room,
                          gscore)
  local score, vt, ahead
  local fits = used + amount <= eff and grace_until <= now
  if fits and quotas then fits = quota_check(room, tenant, amount, res) == 'ok' end
  local dev = ''  -- the device it gets (place); '' on a pool of one device
  if fits and d then
    dev = place(d, amount, pin)
    fits = dev ~= nil
  end
  if qlen > 0 then
    if gscore then
      score = gscore
    else
      score, vt = queue_score(now, prio, tonumber(redis.call('HGET', K_CFG, 'qvt') or '0'))
    end
    local front, front_score, passed = queue_front(quotas, room)
    ahead = front == nil or score < front_score
    -- a tenant's own waiters keep their order: none passes an earlier one passed over
    if fits and passed[tenant] and passed[tenant] < score then fits = false end
    if fits and not ahead then
      local fw = redis.call('HGET', K_WAITERS, front)
      if fw then
        local _, _, front_enq = parse_waiter(fw)
        ahead = backfill_open(now, front_enq)
      end
    end
  end
  return (qlen == 0 or ahead) and fits, dev, score, vt
end

-- Sharded pub/sub where the server has it (Redis >= 7, Valkey >= 7.2: REDIS_VERSION_NUM is
-- set from 7.0 on): on a cluster SPUBLISH stays on the pool's shard (the channel carries the
-- pool's hash tag) where PUBLISH is broadcast to every node. The subscriber picks SSUBSCRIBE
-- by the same rule (gpulock/runtime/listener.py).
local SHARDED = redis.REDIS_VERSION_NUM ~= nil and redis.REDIS_VERSION_NUM >= 0x070000

-- Publish `lines` ({channel id -> {line, ...}}) as messages of kind `kind` ('g' grants, 'y'
-- asks to yield): "<kind> <now_ms>\n<line>\n<line>...", one message per channel.
local function send(now, kind, lines)
  for chan, group in pairs(lines) do
    local ch, msg = K_EVENTS .. ':' .. chan, kind .. ' ' .. fmt(now) .. '\n' .. table.concat(group, '\n')
    if SHARDED then redis.call('SPUBLISH', ch, msg) else redis.call('PUBLISH', ch, msg) end
  end
end

local function publish(now, lines, n)
  if n > 0 then send(now, 'g', lines) end
end

-- A request of this pool did not fit (it queued, refreshed its place, or was refused without
-- queueing): tell the holders of kept bytes (cfg kept as read, `list`; nil or '' when none)
-- to give back those not in use now, and the others at their release. One message per
-- holder's channel, "k <now_ms>\n<lease_id>\n<lease_id>...". Entries whose lease is gone are
-- dropped from the list. Returns how many leases were named.
local function tell_kept(now, list)
  if not list or list == '' then return 0 end
  local lines, n, stale = {}, 0, {}
  for lid, chan in string.gmatch(list, ' (%x+)|(%w+)') do
    if redis.call('HEXISTS', K_HOLDERS, lid) == 1 then
      local group = lines[chan]
      if not group then group = {}; lines[chan] = group end
      group[#group + 1] = lid
      n = n + 1
    else
      stale[#stale + 1] = lid
    end
  end
  for _, lid in ipairs(stale) do
    kept_drop(redis.call('HGET', K_CFG, 'kept'), lid)
  end
  if n > 0 then
    send(now, 'k', lines)
    redis.call('HINCRBY', K_CFG, 'k_told', n)
  end
  return n
end

-- Preemption (docs/SEMANTICS.md, "Preemption"): with the pool's cfg field preempt set to
-- "<gap> <yield_grace_ms>" (configure.lua), the request at the head of the queue, when it
-- cannot fit, asks holders whose priority is at least `gap` below its own to yield:
-- * only leases with a preemption field (pre_field: not resident, not acquired as not
--   preemptible), each at most once (yield_field marks it asked);
-- * just enough of them: in order (lowest priority first, then the youngest, the latest
--   granted, then by lease id) until the bytes free, the bytes of leases asked before and not
--   gone yet, and theirs cover its amount, on its device (a pinned request) or on the device
--   where the fewest leases are asked (a request for any device; lowest index on a tie), and
--   within the effective capacity; then an earlier pick that the later ones make unnecessary
--   is dropped;
-- * none when even all of them leaving would not make it fit, when it is a growth (resize),
--   when its tenant's quota is what holds it back (freeing others' bytes would not grant it),
--   or in the pool's grace period after a data loss (nothing is granted then).
-- A lease asked at server time `now` gets the deadline max(now + yield_grace_ms, its expiry
-- now): no renewal extends it past that (renew.lua), and at it the lease expires as any lease
-- does (its bytes go to the queue, its holder's renewal says lost). The deadline is never
-- before the expiry already granted: the holder may rely on that one (invariant 5). Asking
-- publishes "y <now_ms>\n<lease_id> <deadline_ms>..." on the channel of each lease's process
-- and counts y_asked. `spec`: the cfg field preempt as read (nil or '': off). Returns the
-- number of leases asked. Reads every holder record: O(leases), only when the head cannot fit.
local function ask_yield(now, spec)
  if not spec or spec == '' then return 0 end
  local gap, grace = string.match(spec, '^(%d+) (%d+)$')
  if not gap then return 0 end
  gap, grace = tonumber(gap), tonumber(grace)
  local head = redis.call('ZRANGE', K_QUEUE, 0, 0)
  if #head == 0 then return 0 end
  local w = redis.call('HGET', K_WAITERS, head[1])
  if not w then return 0 end
  local amount, _, _, _, _, _, prio, tenant, pin, res, grow = parse_waiter(w)
  if grow or grace_left(now) > 0 or quota_check({}, tenant, amount, res) ~= 'ok' then return 0 end
  local c = redis.call('HMGET', K_CFG, 'capacity', 'used', 'external', 'external_until', 'devices', 'placement')
  local cap, used = tonumber(c[1] or '0'), tonumber(c[2] or '0')
  local d = load_devices(c[5], c[6])
  local need_pool = amount - (eff_cap(now, cap, tonumber(c[3] or '0'), tonumber(c[4] or '0')) - used)
  if need_pool <= 0 and (not d or place(d, amount, pin) ~= nil) then return 0 end  -- it fits
  local recs = redis.call('HGETALL', K_HOLDERS)
  if #recs == 0 then return 0 end
  local v = {}  -- per holder i (recs[2i-1], recs[2i]): its pre field at v[2i-1], yield field at v[2i]
  for i = 1, #recs, 1000 do  -- HMGET in slices: unpack() has a bounded stack
    local f = {}
    for j = i, math.min(i + 999, #recs), 2 do
      f[#f + 1] = pre_field(recs[j]); f[#f + 1] = yield_field(recs[j])
    end
    local got = redis.call('HMGET', K_TICKETS, unpack(f))
    for k = 1, #got do v[i + k - 1] = got[k] end
  end
  local pend, pend_dev, cands = 0, {}, {}
  for i = 1, #recs, 2 do
    if v[i] then
      local a, _, acq, _, _, _, _, dev = parse_holder(recs[i + 1])
      local dv = tonumber(dev) or 0
      if v[i + 1] then  -- asked before, not gone yet: its bytes are coming
        pend = pend + a
        pend_dev[dv] = (pend_dev[dv] or 0) + a
      else
        local p, ch = string.match(v[i], '^(%-?%d+)|(%w*)$')
        p = tonumber(p)
        if p and p + gap <= prio then cands[#cands + 1] = {p, tonumber(acq), recs[i], a, dv, ch} end
      end
    end
  end
  if #cands == 0 then return 0 end
  table.sort(cands, function(x, y)
    if x[1] ~= y[1] then return x[1] < y[1] end
    if x[2] ~= y[2] then return x[2] > y[2] end
    return x[3] < y[3]
  end)
  need_pool = need_pool - pend
  local devs = {0}
  if d then
    devs = {}
    for i = 0, d.n - 1 do
      if pin == '' or i == tonumber(pin) then devs[#devs + 1] = i end
    end
  end
  local best
  for _, i in ipairs(devs) do
    local need = need_pool
    if d then need = math.max(need, amount - (d.cap[i] - d.used[i]) - (pend_dev[i] or 0)) end
    if need <= 0 then return 0 end  -- enough is on its way already
    local picked, sum = {}, 0
    for _, x in ipairs(cands) do
      if sum >= need then break end
      if not d or x[5] == i then picked[#picked + 1] = x; sum = sum + x[4] end
    end
    if sum >= need then
      local kept = {}
      for k, x in ipairs(picked) do  -- drop an earlier pick the later ones make unnecessary
        if k < #picked and sum - x[4] >= need then sum = sum - x[4] else kept[#kept + 1] = x end
      end
      if best == nil or #kept < #best then best = kept end
    end
  end
  if not best then return 0 end
  local lines = {}
  for _, x in ipairs(best) do
    local lid = x[3]
    local dl = now + grace
    local exp = tonumber(redis.call('ZSCORE', K_LEASES, lid) or '0')
    if exp > dl then dl = exp end
    redis.call('HSET', K_TICKETS, yield_field(lid), fmt(now) .. '|' .. fmt(dl))
    if x[6] ~= '' then
      local group = lines[x[6]]
      if not group then group = {}; lines[x[6]] = group end
      group[#group + 1] = lid .. ' ' .. fmt(dl)
    end
  end
  redis.call('HINCRBY', K_CFG, 'y_asked', #best)
  send(now, 'y', lines)
  return #best
end

-- The yield deadline (server ms) of lease `lid`, or nil when it has not been asked to yield.
local function yield_deadline(lid)
  local y = redis.call('HGET', K_TICKETS, yield_field(lid))
  if not y then return nil end
  return tonumber(string.match(y, '|(%d+)$'))
end

local function grant_head(now, own)
  local head = redis.call('ZRANGE', K_QUEUE, 0, 0)
  if #head == 0 then return {}, 0, false end
  local c = redis.call('HMGET', K_CFG, 'capacity', 'used', 'grace_until', 'external', 'external_until',
                       'devices', 'placement', 'resident', 'preempt')
  local cap = tonumber(c[1] or '0')
  local lines, n, _, mine = grant_from(now, head, cap, tonumber(c[2] or '0'), tonumber(c[3] or '0'),
                                       eff_cap(now, cap, tonumber(c[4] or '0'), tonumber(c[5] or '0')),
                                       load_devices(c[6], c[7]), tonumber(c[8] or '0'), own)
  if c[9] then ask_yield(now, c[9]) end  -- the head now, granted or not, may need to ask
  return lines, n, mine
end


-- Milliseconds until the queue can next move without a release: in a grace period its end
-- (nothing is granted before it, whatever expires meanwhile); else the nearest lease expiry or
-- the expiry of a device report that holds bytes back, whichever is soonest (-1 when none).
local function next_expiry_in(now)
  local g = grace_left(now)
  if g > 0 then return g end
  local first = redis.call('ZRANGE', K_LEASES, 0, 0, 'WITHSCORES')
  local d = -1
  if #first > 0 then
    d = tonumber(first[2]) - now
    if d < 0 then d = 0 end
  end
  local x = redis.call('HMGET', K_CFG, 'external', 'external_until')
  local xu = tonumber(x[2] or '0')
  if tonumber(x[1] or '0') > 0 and xu > now and (d < 0 or xu - now < d) then d = xu - now end
  return d
end

-- acquire's reply when it grants nothing now: {code, position, retry_after_ms, queue_len,
-- now_ms, epoch, capacity, used, held_back, grace_left_ms, resident (0 unless code 3),
-- ahead_bytes, amount, bytes_per_s, grants_per_ks, ahead_count, out_of_order_pm} (see
-- acquire.lua; the last six: wait_inputs, for a waiter of `tenant`). resize.lua's has the same
-- shape, its `current` in resident's place.
local function not_granted(code, pos, now, epoch, cap, eff, resident, amount, tenant)
  local ahead, a, b, g, count, o = wait_inputs(now, pos, amount, tenant)
  return {code, pos, next_expiry_in(now), redis.call('ZCARD', K_QUEUE), now,
          epoch, cap, cfg_num('used'), cap - eff, grace_left(now), resident or 0, ahead, a, b, g,
          count, o}
end

local function grant_reply(now, lid)
  local rec = redis.call('HGET', K_HOLDERS, lid)
  local amount, token, _, _, _, _, _, dev = parse_holder(rec)
  local exp = redis.call('ZSCORE', K_LEASES, lid)
  return {1, lid, tonumber(token), tonumber(exp), amount, now,
          cfg_num('epoch'), cfg_num('capacity'), cfg_num('used'), tonumber(dev) or 0}
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
