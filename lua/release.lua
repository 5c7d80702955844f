-- release.lua: end a lease and hand its bytes to the head of the queue (server-side hand-off).
-- KEYS: the eight pool keys described in lib.lua.
-- ARGV:
--   1 lease_id   32 hex digits
--   2 token      the lease's fencing token (decimal); the lease is released only if it matches
--   3 mode       optional: '' (release) or 'keep': keep the lease instead when nobody waits
--                (lib.lua "Kept bytes"): the queue is empty, the pool is not in a grace
--                period, and the lease is not resident and not asked to yield
--   4 channel    with 'keep': the holder's channel id, told when a request does not fit
-- A lease asked to yield (lib.lua "Preemption") released before its deadline counts as yielded.
-- Reply:
--   {1, now_ms, used, granted}   released; `granted` waiters were handed bytes and notified
--   {2, now_ms, used, 0}         kept, not released ('keep' and nobody waits): the lease is
--                                unchanged but listed as kept (cfg field kept)
--   {0, now_ms, used, granted}   lost: no such live lease (expired and reaped, released before,
--                                never existed, or another token); nothing of others is freed
-- Errors (nothing written): GPULOCK_BADARG <why>

local lid, e = lease_id_arg(ARGV[1]); if e then return e end
local token; token, e = int_arg(ARGV[2], 'token', 0, MAX_AMOUNT); if e then return e end
local keep = ARGV[3] == 'keep'
if ARGV[3] ~= nil and ARGV[3] ~= '' and not keep then
  return bad("mode must be '' or 'keep', got " .. show(ARGV[3]))
end
local chan
if keep then chan, e = channel_arg(ARGV[4]); if e then return e end end

-- Reads first: every key this call may use is read (redis.pcall) before the first write, so a
-- key of the wrong type fails it with nothing written (see "Key types" in lib.lua); the one
-- exception is the tickets hash in the common case, whose HDEL is then the first write.
local cfg = redis.pcall('HMGET', K_CFG, 'capacity', 'used', 'grace_until', 'external', 'external_until',
                        'devices', 'placement', 'resident', 'preempt', 'kept')
if failed(cfg) then return keytype_error(cfg) end
local now = now_ms()
if not cfg[1] then
  -- No configuration: nothing to release. Still an error if a key has the wrong type.
  return check_types() or {0, now, 0, 0}
end
local rec = redis.pcall('HGET', K_HOLDERS, lid)
if failed(rec) then return keytype_error(rec) end
local nstr = fmt(now)
local dead = redis.pcall('ZRANGEBYSCORE', K_LEASES, '-inf', nstr)
if failed(dead) then return keytype_error(dead) end
local head = redis.pcall('ZRANGE', K_QUEUE, 0, 0)
if failed(head) then return keytype_error(head) end
local gone = {}
if #head > 0 then  -- waiters are read or dropped (an empty queue has none: see acquire.lua)
  gone = redis.pcall('ZRANGEBYSCORE', K_WEXP, '-inf', nstr)
  if failed(gone) then return keytype_error(gone) end
  local r = redis.pcall('HEXISTS', K_WAITERS, head[1])
  if failed(r) then return keytype_error(r) end
end
local mine, amount, ticket, tenant, dev, res = false, 0, '', '', '', false
if rec then
  local a, tok, _, _, t, _, tn, dv, rs = parse_holder(rec)
  amount, ticket, tenant, dev, res = a, t, tn, dv, rs
  mine = tonumber(tok) == token  -- another token: not ours to release
end
local asked  -- with preemption on: whether it was asked to yield (lib.lua "Preemption")
if mine and cfg[9] then
  asked = redis.pcall('HGET', K_TICKETS, yield_field(lid))
  if failed(asked) then return keytype_error(asked) end
end
if #head > 0 or #dead > 0 then
  -- a hand-off or a reap writes the tickets hash before our own HDEL would
  local r = redis.pcall('HEXISTS', K_TICKETS, ticket)
  if failed(r) then return keytype_error(r) end
end

-- Validation and reads done; writes start here.
local cap, used, grace_until = tonumber(cfg[1]), tonumber(cfg[2] or '0'), tonumber(cfg[3] or '0')
local rh = tonumber(cfg[8] or '0')
local ok = 0
if #dead + #gone > 0 then
  reap_found(dead, gone)
  if mine and redis.call('HEXISTS', K_HOLDERS, lid) == 0 then mine = false end  -- it had expired
  used = cfg_num('used')
  rh = cfg_num('resident')
  head = redis.call('ZRANGE', K_QUEUE, 0, 0)
  cfg[10] = redis.call('HGET', K_CFG, 'kept')
end
if mine and keep and #head == 0 and not res and not asked and grace_until <= now then
  -- nobody waits: the holder keeps it (lib.lua "Kept bytes")
  if not kept_has(cfg[10], lid) then
    redis.call('HSET', K_CFG, 'kept', (cfg[10] or '') .. ' ' .. lid .. '|' .. chan)
  end
  redis.call('HINCRBY', K_CFG, 'k_kept', 1)
  return {2, now, used, 0}
end
if mine then
  -- drop_lease, with what was read above; the tickets HDEL first (see "Reads first")
  -- and the lease's place (lib.lua lease_place) with it
  local r
  if ticket ~= '' then
    r = redis.pcall('HDEL', K_TICKETS, ticket, place_field(lid), pre_field(lid), yield_field(lid))
  else
    r = redis.pcall('HDEL', K_TICKETS, place_field(lid), pre_field(lid), yield_field(lid))
  end
  if failed(r) then return keytype_error(r) end
  if asked then yield_gone(asked, true, now) end
  redis.call('ZREM', K_LEASES, lid)
  redis.call('HDEL', K_HOLDERS, lid)
  used = used - amount
  redis.call('HSET', K_CFG, 'used', fmt(used))
  tenant_add(tenant, -amount)
  device_add(dev, -amount)
  if res then
    resident_add(tenant, dev, -amount)
    rh = rh - amount
  else
    kept_drop(cfg[10], lid)
  end
  ok = 1
end
local n = 0
if #head > 0 then
  local lines
  lines, n, used = grant_from(now, head, cap, used, grace_until,
                              eff_cap(now, cap, tonumber(cfg[4] or '0'), tonumber(cfg[5] or '0')),
                              load_devices(cfg[6], cfg[7]), rh)
  publish(now, lines, n)
  if cfg[9] then ask_yield(now, cfg[9]) end  -- the head now may need to ask (lib.lua "Preemption")
end
return {ok, now, used, n}
