-- reassert.lua: after Redis lost a pool's data (a restart without persistence) and the pool
-- (KEYS and ARGV: see the header below; KEYS are the eight pool keys of lib.lua.)
-- was created again, a holder puts back the leases it still holds, each with its old lease
-- id, amount and fencing token: the grace period in docs/SEMANTICS.md (NFS's reclaim after a server
-- reboot). Batched: one call for all the leases of one process.
-- A re-assertion is accepted only when
--   * its token is older than this incarnation of the pool (token < epoch: the fence of a
--     created pool starts at the server clock in µs, above every token issued before);
--   * it comes within one max_ttl_ms of the pool's creation: a lease from before the loss
--     that is still valid on its holder's clock cannot be older than that (renewal never
--     re-acquires: later, an unknown lease is simply lost);
--   * its ttl is within the pool's max_ttl_ms, and its amount fits next to the leases already
--     there (the capacity holds at every instant).
-- Any re-assertion attempt within that window also opens the grace period if the pool was
-- created without one (by a process that did not know it had existed): no new grant until
-- one max_ttl_ms after the creation, so the other holders from before can come back too.
-- KEYS: the eight pool keys described in lib.lua.
-- ARGV:
--   1 n               count of lease records that follow
--   then n x          lease_id (32 hex), token, amount (bytes), ttl_ms, ticket ('' for none),
--                     meta (<= 512 bytes), tenant ('' for none), device (its index; '' or 0
--                     on a pool of one device) when the call has 1 + 8 x n arguments, and kind
--                     ('' or 'resident', lib.lua "Resident leases") when it has 1 + 9 x n
--                     (earlier versions send 7 per lease, no device, or 6, no tenant either);
--                     and its preemption field "<priority>|<channel>" ('' : never asked to
--                     yield; lib.lua "Preemption") when it has 1 + 10 x n. A lease put back is
--                     one not asked to yield yet.
--                     A lease put back counts toward its tenant's bytes; its tenant's quota
--                     does not refuse it (it was granted before the loss), the capacity of
--                     the pool and of its device do.
-- Reply: {now_ms, epoch, grace_left_ms, results}
--   results: one per lease, in order: the new expires_ms (> 0, accepted; also when the lease is
--   already there with the same token), or a refusal:
--     -1 late    more than one max_ttl_ms after the pool's creation
--     -2 full    it does not fit in the capacity (or its device's) next to the leases
--                already there, or its device is not one of the pool's
--     -3 newer   its token is not older than this incarnation of the pool
--     -4 ttl     its ttl is longer than the pool's max_ttl_ms
--     -5 taken   its lease id or its ticket is there with another lease
-- Errors (nothing written): GPULOCK_BADARG <why>, GPULOCK_NOPOOL

local type_err = check_types(); if type_err then return type_err end
local n, e = int_arg(ARGV[1], 'n_leases', 0, 100000); if e then return e end
local recs = {}
local i = 2
local width = 6
if #ARGV == 1 + 7 * n then width = 7 end
if #ARGV == 1 + 8 * n then width = 8 end
if #ARGV == 1 + 9 * n then width = 9 end
if #ARGV == 1 + 10 * n then width = 10 end
for k = 1, n do
  local lid; lid, e = lease_id_arg(ARGV[i]); if e then return e end
  local tok; tok, e = int_arg(ARGV[i + 1], 'token', 0, MAX_AMOUNT); if e then return e end
  local amount; amount, e = int_arg(ARGV[i + 2], 'amount', 1, MAX_AMOUNT); if e then return e end
  local ttl; ttl, e = int_arg(ARGV[i + 3], 'ttl_ms', MIN_TTL_MS, MAX_TTL_MS); if e then return e end
  local ticket = ARGV[i + 4]
  if ticket ~= '' then ticket, e = id_arg(ticket, 'ticket'); if e then return e end end
  local meta; meta, e = meta_arg(ARGV[i + 5]); if e then return e end
  local tenant = ''
  if width >= 7 then tenant, e = tenant_arg(ARGV[i + 6]); if e then return e end end
  local dev = ''
  if width >= 8 and ARGV[i + 7] ~= '' then
    dev, e = int_arg(ARGV[i + 7], 'device', 0, MAX_DEVICES - 1); if e then return e end
  end
  local resident = width >= 9 and ARGV[i + 8] == 'resident'
  if width >= 9 and not resident and ARGV[i + 8] ~= '' then
    return bad("kind must be '' or 'resident', got " .. show(ARGV[i + 8]))
  end
  local pre = nil  -- its preemption field (lib.lua "Preemption"): "<priority>|<channel>"
  if width == 10 and ARGV[i + 9] ~= '' then
    local p, ch = string.match(ARGV[i + 9], '^(%-?%d+)|(%w*)$')
    if not p then return bad("preemption field must be '<priority>|<channel>', got " .. show(ARGV[i + 9])) end
    p, e = prio_arg(p); if e then return e end
    if not resident then pre = fmt(p) .. '|' .. ch end
  end
  recs[k] = {lid, tok, amount, ttl, ticket, meta, tenant, dev, resident, pre}
  i = i + width
end

local cfg = redis.call('HMGET', K_CFG, 'capacity', 'epoch', 'created_ms', 'max_ttl_ms', 'grace_until',
                       'devices', 'placement')
if not cfg[1] then return redis.error_reply('GPULOCK_NOPOOL') end
local cap, epoch, created = tonumber(cfg[1]), tonumber(cfg[2]), tonumber(cfg[3] or '0')
local max_ttl = tonumber(cfg[4] or '0')
local window_end = created + (max_ttl > 0 and max_ttl or MAX_TTL_MS)

-- Validation done; writes start here.
local now = now_ms()
reap(now)
local used = cfg_num('used')
local d = load_devices(cfg[6], cfg[7])
local res = {}
local tried = false
for k, r in ipairs(recs) do
  local lid, tok, amount, ttl, ticket, meta, tenant, dev = r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8]
  local resident = r[9]
  if not d then dev = '' end  -- a pool of one device: its leases have no device index
  local dev_full = d and (dev == '' or dev >= d.n or d.used[dev] + amount > d.cap[dev])
  if tok >= epoch then
    res[k] = -3
  elseif now >= window_end then
    res[k] = -1
  elseif max_ttl > 0 and ttl > max_ttl then
    res[k] = -4
  else
    tried = true
    local rec = redis.call('HGET', K_HOLDERS, lid)
    local other = ticket ~= '' and redis.call('HGET', K_TICKETS, ticket)
    if rec then
      local _, t = parse_holder(rec)
      if tonumber(t) == tok then  -- re-asserted before (a retry): extend it
        redis.call('ZADD', K_LEASES, 'XX', fmt(now + ttl), lid)
        res[k] = now + ttl
      else
        res[k] = -5
      end
    elseif other and other ~= lid then
      res[k] = -5
    elseif used + amount > cap or dev_full then
      res[k] = -2
    else
      redis.call('ZADD', K_LEASES, fmt(now + ttl), lid)
      redis.call('HSET', K_HOLDERS, lid, holder_record(amount, tok, now, ttl, ticket, tenant, meta, dev, resident))
      if ticket ~= '' then redis.call('HSET', K_TICKETS, ticket, lid) end
      if r[10] then redis.call('HSET', K_TICKETS, pre_field(lid), r[10]) end
      redis.call('HINCRBY', K_CFG, 'used', fmt(amount))
      tenant_add(tenant, amount)
      device_add(dev, amount)
      if resident then resident_add(tenant, dev, amount) end
      if d then d.used[dev] = d.used[dev] + amount end
      redis.call('HINCRBY', K_CFG, 'reasserted', 1)
      used = used + amount
      res[k] = now + ttl
    end
  end
end
if tried and tonumber(cfg[5] or '0') < window_end then
  redis.call('HSET', K_CFG, 'grace_until', fmt(window_end))
end
publish(now, grant_head(now))
return {now, epoch, grace_left(now), res}
