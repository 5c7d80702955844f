-- configure.lua: create a pool, or change its capacity, queue bound, queue policy, tenant
-- quotas, devices and preemption.
-- (KEYS and ARGV: see the header below; KEYS are the eight pool keys of lib.lua.)
-- Creating a pool seeds its fencing counter and its epoch from the server clock in
-- microseconds, so tokens keep increasing when Redis restarts empty and the pool is made
-- again (as long as the Redis host's clock does not step back), and clients can tell the new
-- pool from the old one by its epoch.
-- KEYS: the eight pool keys described in lib.lua.
-- ARGV:
--   1 capacity      bytes, integer, 1 .. 2^53-1
--   2 max_waiters   queue bound, 1 .. 1000000
--   3 mode          'set' (create or update) or 'create' (create only; an existing pool is
--                   left as it is and reported)
--   4 max_ttl_ms    optional: the longest ttl a lease of this pool may have (100 .. 86400000;
--                   0 or absent: no bound but the protocol's). Also the length of a grace
--                   period. 'set' changes it only when given.
--   5 grace         optional: '1' when the caller knows the pool existed and Redis lost it
--                   (it held leases, or saw the pool's epoch, and finds the pool gone). A pool
--                   created so opens a grace period of one max_ttl_ms (86400000 when unset):
--                   until it ends nothing new is granted (requests queue), and holders of
--                   leases from before the loss re-assert them (reassert.lua). Ignored when
--                   the pool exists.
--   6 policy        optional: 'fifo' (the default of a pool created) or 'backfill' (lib.lua
--                   backfill_open); '' or absent: unchanged.
--   7 backfill_ms   optional: the backfill window, ms (1 .. 86400000; a pool created has 2000);
--                   '' or absent: unchanged.
--   8 quotas        optional: tenant quotas to set, "<tenant>=<bytes>" separated by spaces
--                   (tenant: lib.lua tenant_arg; bytes 0 removes that tenant's quota); the
--                   tenants not named keep theirs. '' or absent: unchanged.
--   9 devices       optional: the capacity of each device, "<bytes> <bytes> ..." (1 ..
--                   MAX_DEVICES items, device 0 first; lib.lua "Devices"); capacity (ARGV 1)
--                   must be their sum. One item makes a pool of one device. The count of
--                   devices changes only while the pool has no lease and no waiter. '' or
--                   absent: unchanged; then, on a pool of several devices, capacity must be
--                   the pool's capacity now (its devices say how it is split).
--  10 placement     optional: 'bestfit' (the default of a pool created) or 'spread' (lib.lua
--                   place); '' or absent: unchanged.
--  11 preempt       optional: "<gap> <yield_grace_ms>" turns preemption on (lib.lua "Preemption":
--                   gap 1 .. 200 priority levels, yield_grace_ms 100 .. 86400000), 'off' turns
--                   it off (leases asked already keep their deadlines); '' or absent: unchanged.
-- Reply: {created (1/0), capacity, epoch, used, max_waiters, max_ttl_ms, grace_left_ms, policy,
--         backfill_ms, quotas (every quota the pool has, "<tenant>=<bytes> ..." sorted by
--         tenant; '' when none), devices ("<bytes> ..." per device; '' on a pool of one
--         device), placement, preempt ("<gap> <yield_grace_ms>", '' when off)}
--   Lowering a tenant's quota below what it holds is allowed as lowering capacity is; queued
--   requests of the tenant larger than its new quota leave the queue (GPULOCK_QUOTA).
--   Lowering capacity below `used` is allowed: leases keep their bytes, nothing new is granted
--   until used falls below the new capacity. Raising it grants waiters that now fit. Queued
--   requests larger than the new capacity leave the queue (they could never be granted and
--   would block those behind them); their clients get GPULOCK_CAPACITY when they ask again.
--   Lowering a device's capacity below what its leases hold is allowed likewise; queued
--   requests pinned to it that it can never fit leave the queue.
-- Errors (nothing written): GPULOCK_BADARG <why>

local type_err = check_types(); if type_err then return type_err end
local cap, e = int_arg(ARGV[1], 'capacity', 1, MAX_AMOUNT); if e then return e end
local maxw; maxw, e = int_arg(ARGV[2], 'max_waiters', MIN_WAITERS, MAX_WAITERS); if e then return e end
local mode = ARGV[3]
if mode ~= 'set' and mode ~= 'create' then return bad("mode must be 'set' or 'create', got " .. show(mode)) end
local max_ttl = nil
if ARGV[4] ~= nil and ARGV[4] ~= '' and ARGV[4] ~= '0' then
  max_ttl, e = int_arg(ARGV[4], 'max_ttl_ms', MIN_TTL_MS, MAX_TTL_MS); if e then return e end
end
local grace = ARGV[5]
if grace ~= nil and grace ~= '0' and grace ~= '1' then return bad("grace must be '0' or '1', got " .. show(grace)) end
local policy = ARGV[6]
if policy == '' then policy = nil end
if policy ~= nil then
  policy, e = one_of(policy, POLICIES, 'policy'); if e then return e end
end
local bf_ms = nil
if ARGV[7] ~= nil and ARGV[7] ~= '' then
  bf_ms, e = int_arg(ARGV[7], 'backfill_ms', MIN_BACKFILL_MS, MAX_BACKFILL_MS); if e then return e end
end
local quotas = {}  -- {tenant, bytes} in the order given
if ARGV[8] ~= nil and ARGV[8] ~= '' then
  if #ARGV[8] > 65536 then return bad('quotas must be at most 65536 bytes') end
  for item in string.gmatch(ARGV[8], '%S+') do
    local t, b = string.match(item, '^([^=]+)=(.*)$')
    if not t then return bad("quotas must be '<tenant>=<bytes>' items, got " .. show(item)) end
    t, e = tenant_arg(t); if e then return e end
    b, e = int_arg(b, 'quota of tenant ' .. t, 0, MAX_AMOUNT); if e then return e end
    quotas[#quotas + 1] = {t, b}
  end
end
local devs = nil  -- the devices' capacities in order, when given
if ARGV[9] ~= nil and ARGV[9] ~= '' then
  devs = {}
  local sum = 0
  for item in string.gmatch(ARGV[9], '%S+') do
    if #devs >= MAX_DEVICES then return bad('devices must be at most ' .. MAX_DEVICES .. ' capacities') end
    local b; b, e = int_arg(item, 'capacity of device ' .. #devs, 1, MAX_AMOUNT); if e then return e end
    devs[#devs + 1] = b
    sum = sum + b
  end
  if #devs == 0 then return bad('devices must list at least one capacity') end
  if sum ~= cap then
    return bad('capacity ' .. fmt(cap) .. " must be the sum of the devices' capacities, " .. fmt(sum))
  end
end
local placement = ARGV[10]
if placement == '' then placement = nil end
if placement ~= nil then
  placement, e = one_of(placement, PLACEMENTS, 'placement'); if e then return e end
end
local preempt = ARGV[11]  -- nil: unchanged, false: off, else the field's value
if preempt == '' then preempt = nil elseif preempt == 'off' then preempt = false end
if preempt then
  local g, ms = string.match(preempt, '^(%S+) (%S+)$')
  if not g then return bad("preempt must be '<gap> <yield_grace_ms>' or 'off', got " .. show(preempt)) end
  g, e = int_arg(g, 'preemption gap', PREEMPT_GAP_MIN, PREEMPT_GAP_MAX); if e then return e end
  ms, e = int_arg(ms, 'yield_grace_ms', MIN_YIELD_GRACE_MS, MAX_YIELD_GRACE_MS); if e then return e end
  preempt = fmt(g) .. ' ' .. fmt(ms)
end
local had_n = tonumber(redis.call('HGET', K_CFG, 'devices') or '1')
if mode == 'set' and redis.call('EXISTS', K_CFG) == 1 then
  if devs and #devs ~= had_n and redis.call('ZCARD', K_LEASES) + redis.call('ZCARD', K_QUEUE) > 0 then
    return bad('the pool has ' .. fmt(had_n) .. ' device(s) and leases or waiters: its count of devices '
      .. 'changes only when it has none')
  end
  if not devs and had_n > 1 and cap ~= cfg_num('capacity') then
    return bad('the pool has ' .. fmt(had_n) .. ' devices: give each one a capacity (devices), '
      .. 'not capacity ' .. fmt(cap) .. ' alone')
  end
end

-- Write the devices' capacities (a pool of one device: remove the fields of several).
local function set_devices()
  if not devs then return end
  local n = #devs
  for i = n, math.max(had_n, n) - 1 do redis.call('HDEL', K_CFG, 'dcap:' .. i, 'dused:' .. i, 'dres:' .. i) end
  if n < 2 then
    redis.call('HDEL', K_CFG, 'devices', 'dcap:0', 'dused:0')
    return
  end
  redis.call('HSET', K_CFG, 'devices', fmt(n))
  for i = 0, n - 1 do redis.call('HSET', K_CFG, 'dcap:' .. i, fmt(devs[i + 1])) end
end

local now = now_ms()
local created = 0
if redis.call('EXISTS', K_CFG) == 0 then
  -- Leases without a configuration can only come from a hand-deleted cfg key: count them
  -- rather than forget them.
  local used, tused, dused, resident = 0, {}, {}, {}
  for _, rec in ipairs(redis.call('HVALS', K_HOLDERS)) do
    local a, _, _, _, _, _, tenant, dev, res = parse_holder(rec)
    used = used + a
    if tenant ~= '' then tused[tenant] = (tused[tenant] or 0) + a end
    if dev ~= '' then dused[dev] = (dused[dev] or 0) + a end
    if res then resident[#resident + 1] = {tenant, dev, a} end
  end
  local us = now_us()
  local grace_until = 0
  if grace == '1' then grace_until = now + (max_ttl or MAX_TTL_MS) end
  redis.call('HSET', K_CFG, 'capacity', fmt(cap), 'max_waiters', fmt(maxw), 'used', fmt(used),
             'fence', fmt(us), 'epoch', fmt(us), 'qvt', '0', 'created_ms', fmt(now),
             'grants', '0', 'reaped_leases', '0', 'reaped_waiters', '0',
             'max_ttl_ms', fmt(max_ttl or 0), 'grace_until', fmt(grace_until),
             'policy', policy or POLICIES[1], 'backfill_ms', fmt(bf_ms or DEFAULT_BACKFILL_MS),
             'nquotas', '0', 'placement', placement or PLACEMENTS[1])
  for t, a in pairs(tused) do redis.call('HSET', K_CFG, 'tused:' .. t, fmt(a)) end
  for _, r in ipairs(resident) do resident_add(r[1], (devs and #devs > 1) and r[2] or '', r[3]) end
  had_n = 1
  set_devices()
  if devs and #devs > 1 then
    for i = 0, #devs - 1 do redis.call('HSET', K_CFG, 'dused:' .. i, fmt(dused[fmt(i)] or 0)) end
  end
  created = 1
elseif mode == 'set' then
  redis.call('HSET', K_CFG, 'capacity', fmt(cap), 'max_waiters', fmt(maxw))
  if placement then redis.call('HSET', K_CFG, 'placement', placement) end
  set_devices()
  if devs and #devs > 1 and #devs ~= had_n then
    for i = 0, #devs - 1 do redis.call('HSET', K_CFG, 'dused:' .. i, '0') end  -- no lease: checked above
  end
  if max_ttl then redis.call('HSET', K_CFG, 'max_ttl_ms', fmt(max_ttl)) end
  if policy then redis.call('HSET', K_CFG, 'policy', policy) end
  if bf_ms then redis.call('HSET', K_CFG, 'backfill_ms', fmt(bf_ms)) end
end
if created == 1 or mode == 'set' then
  if preempt then redis.call('HSET', K_CFG, 'preempt', preempt)
  elseif preempt == false then redis.call('HDEL', K_CFG, 'preempt') end
  for _, q in ipairs(quotas) do
    local field = 'quota:' .. q[1]
    local had = redis.call('HEXISTS', K_CFG, field) == 1
    if q[2] > 0 then
      redis.call('HSET', K_CFG, field, fmt(q[2]))
      if not had then redis.call('HINCRBY', K_CFG, 'nquotas', 1) end
    elseif had then
      redis.call('HDEL', K_CFG, field)
      redis.call('HINCRBY', K_CFG, 'nquotas', -1)
    end
  end
end
reap(now)
publish(now, grant_head(now))
local pc = redis.call('HMGET', K_CFG, 'policy', 'backfill_ms', 'devices', 'placement', 'preempt')
local spec = {}
local d = load_devices(pc[3], pc[4])
if d then for i = 0, d.n - 1 do spec[#spec + 1] = fmt(d.cap[i]) end end
return {created, cfg_num('capacity'), cfg_num('epoch'), cfg_num('used'), cfg_num('max_waiters'),
        cfg_num('max_ttl_ms'), grace_left(now), pc[1] or POLICIES[1],
        tonumber(pc[2] or fmt(DEFAULT_BACKFILL_MS)), quota_spec(), table.concat(spec, ' '),
        pc[4] or PLACEMENTS[1], pc[5] or ''}
