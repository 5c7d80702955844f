-- status.lua: a consistent snapshot of one pool (after reaping, so `used` counts only live
-- leases and the queue only live waiters).
-- KEYS: the eight pool keys described in lib.lua.
-- ARGV:
--   1 limit   the most leases and the most waiters to list (0 .. 100000); counts are exact
-- Reply:
--   {0, now_ms} when the pool has no configuration, else
--   {1, now_ms, capacity, used, epoch, fence, max_waiters, n_leases, n_waiters,
--    grants, reaped_leases, reaped_waiters,
--    leases  = {{lease_id, amount, token, expires_ms, acquired_ms, ttl_ms, ticket, meta,
--                tenant, device, yield_deadline_ms, priority}, ...} (soonest expiry first;
--                device 0 on a pool of one device; yield_deadline_ms 0 when not asked to
--                yield; priority as a string, '' for a lease never asked: lib.lua
--                "Preemption"; kept 1 for a lease its holder keeps: lib.lua "Kept bytes"),
--    waiters = {{ticket, amount, enqueued_ms, waiter_expires_ms, meta, priority, tenant,
--                device, growth_of, growth_token, ahead_bytes, ahead_count}, ...} (queue
--                order; ahead_bytes, ahead_count: the bytes and the count of the waiters ahead
--                of it, as acquire.lua replies them, lib.lua ahead_of; device: the pinned
--                device, -1 for any; growth_of: for the growth of a held lease (resize.lua)
--                the lease's id, amount being the bytes it grows by, and growth_token its
--                fencing token, meta its holder's; '' and 0 for a new request),
--    grace_left_ms (0: no grace period), max_ttl_ms (0: unbounded), reasserted,
--    external (bytes of the device report, 0 when none counts), external_left_ms (how long the
--    report still counts; 0: none), overuse (the report's over-users, JSON text; '' when none),
--    policy ('fifo' or 'backfill'), backfill_ms,
--    tenants = {tenant, used, quota, tenant, used, quota, ...} (every tenant with a quota or
--              with live leases, sorted by name; quota 0: none),
--    devices = {capacity, used, capacity, used, ...} (per device, device 0 first; {} on a pool
--              of one device), placement ('bestfit' or 'spread'),
--    resident (bytes held by resident leases), resident_queued (bytes of resident requests
--    queued): lib.lua "Resident leases",
--    bytes_per_s, grants_per_ks, out_of_order_pm: the queue's drain rate, bytes per second
--    and grants per 1000 seconds of busy time, and per mille of its grants out of arrival
--    order, 0, 0, 0 while not measured (lib.lua "Drain rate"); with capacity, used, external
--    and a listed waiter's ahead_bytes and ahead_count, its wait estimate,
--    preempt ("<gap> <yield_grace_ms>", '' when off), y_asked (leases asked to yield),
--    y_done (of them, released before their deadline), y_done_ms (their total ms from the ask
--    to the release), y_taken (of them, expired instead): lib.lua "Preemption",
--    kept_bytes, kept_count (the bytes and the count of the leases kept by their holders),
--    k_kept (releases answered 'kept'), k_told (kept leases whose holders were told to give
--    them back): lib.lua "Kept bytes"}
-- Errors (nothing written): GPULOCK_BADARG <why>

local type_err = check_types(); if type_err then return type_err end
local limit, e = int_arg(ARGV[1], 'limit', 0, 100000); if e then return e end
local now = now_ms()
if redis.call('EXISTS', K_CFG) == 0 then return {0, now} end
reap(now)
publish(now, grant_head(now))

local x = redis.call('HMGET', K_CFG, 'external', 'external_until', 'overuse')
local ext, ext_left, overuse = 0, 0, ''
if tonumber(x[2] or '0') > now then
  ext, ext_left, overuse = tonumber(x[1] or '0'), tonumber(x[2]) - now, x[3] or ''
end

local kept_list = redis.call('HGET', K_CFG, 'kept')  -- lib.lua "Kept bytes"
local kept_bytes, kept_count = 0, 0
if kept_list then
  for lid in string.gmatch(kept_list, ' (%x+)|') do
    local rec = redis.call('HGET', K_HOLDERS, lid)
    if rec then
      kept_bytes = kept_bytes + parse_holder(rec)
      kept_count = kept_count + 1
    end
  end
end
local leases = {}
if limit > 0 then
  local ids = redis.call('ZRANGE', K_LEASES, 0, limit - 1, 'WITHSCORES')
  for j = 1, #ids, 2 do
    local rec = redis.call('HGET', K_HOLDERS, ids[j])
    if rec then
      local amount, tok, acq, ttl, ticket, meta, tenant, dev = parse_holder(rec)
      local pr = redis.call('HMGET', K_TICKETS, pre_field(ids[j]), yield_field(ids[j]))
      leases[#leases + 1] = {ids[j], amount, tonumber(tok), tonumber(ids[j + 1]), tonumber(acq),
                             tonumber(ttl), ticket, meta, tenant, tonumber(dev) or 0,
                             tonumber(pr[2] and string.match(pr[2], '|(%d+)$') or '0'),
                             pr[1] and string.match(pr[1], '^(%-?%d+)|') or '',
                             kept_has(kept_list, ids[j]) and 1 or 0}
    end
  end
end
local waiters = {}
if limit > 0 then
  local ts = redis.call('ZRANGE', K_QUEUE, 0, limit - 1)
  local walk = ahead_walk(now, #ts - 1)  -- the bytes and count ahead of each (lib.lua ahead_of)
  for j, t in ipairs(ts) do
    local rec = redis.call('HGET', K_WAITERS, t)
    if rec then
      local amount, _, enq, lid, _, meta, prio, tenant, pin, _, grow = parse_waiter(rec)
      local of, gtok = '', 0
      if grow then
        of = lid
        local h = redis.call('HGET', K_HOLDERS, lid)
        if h then
          local _, tok, _, _, _, hmeta = parse_holder(h)
          gtok = tonumber(tok)
          if meta == '' then meta = hmeta end
        end
      end
      local ahead, count = ahead_of(walk, j - 1, amount, tenant)
      waiters[#waiters + 1] = {t, amount, tonumber(enq), tonumber(redis.call('ZSCORE', K_WEXP, t) or '0'), meta,
                               prio, tenant, tonumber(pin) or -1, of, gtok, ahead, count}
    end
  end
end
local tenants, names = {}, {}
local tt = tenant_table()
for t in pairs(tt) do names[#names + 1] = t end
table.sort(names)
for _, t in ipairs(names) do
  tenants[#tenants + 1] = t
  tenants[#tenants + 1] = tt[t][2]
  tenants[#tenants + 1] = tt[t][1]
end
local bps, gpks, oopm = drain_rate()
local devices = {}
local dv = redis.call('HMGET', K_CFG, 'devices', 'placement')
local d = load_devices(dv[1], dv[2])
if d then
  for i = 0, d.n - 1 do
    devices[#devices + 1] = d.cap[i]
    devices[#devices + 1] = d.used[i]
  end
end
return {1, now, cfg_num('capacity'), cfg_num('used'), cfg_num('epoch'), cfg_num('fence'),
        cfg_num('max_waiters'), redis.call('ZCARD', K_LEASES), redis.call('ZCARD', K_QUEUE),
        cfg_num('grants'), cfg_num('reaped_leases'), cfg_num('reaped_waiters'), leases, waiters,
        grace_left(now), cfg_num('max_ttl_ms'), cfg_num('reasserted'), ext, ext_left, overuse,
        redis.call('HGET', K_CFG, 'policy') or POLICIES[1],
        tonumber(redis.call('HGET', K_CFG, 'backfill_ms') or DEFAULT_BACKFILL_MS), tenants,
        devices, dv[2] or PLACEMENTS[1], cfg_num('resident'), cfg_num('rqueued'), bps, gpks, oopm,
        redis.call('HGET', K_CFG, 'preempt') or '', cfg_num('y_asked'), cfg_num('y_done'),
        cfg_num('y_done_ms'), cfg_num('y_taken'), kept_bytes, kept_count, cfg_num('k_kept'),
        cfg_num('k_told')}
