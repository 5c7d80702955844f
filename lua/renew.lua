-- renew.lua: one process's heartbeat, batched: extend its leases and refresh its waiters in
-- (KEYS and ARGV: see the header below; KEYS are the eight pool keys of lib.lua.)
-- one round trip (the cost does not grow with the number of leases a process holds). Renewal
-- never re-acquires: a lease that has expired or is unknown is reported lost and not recreated.
-- The waiter part doubles as the backstop re-poll: a ticket granted by a hand-off whose
-- pub/sub message was missed gets its grant here.
-- KEYS: the eight pool keys described in lib.lua.
-- ARGV:
--   1 n_leases         count of lease triples that follow
--   then n_leases x    lease_id, token, ttl_ms   (new expiry = now + ttl_ms)
--   then n_tickets     count of ticket pairs that follow
--   then n_tickets x   ticket, waiter_ttl_ms     (new waiter expiry = now + waiter_ttl_ms)
-- Reply: {now_ms, epoch (0: pool not configured), lease_results, ticket_results, queue, yields}
--   lease_results:  one per lease, in order: new expires_ms, or 0 when lost; never past the
--                   lease's yield deadline (lib.lua "Preemption")
--   yields:         one per lease, in order: its yield deadline, server ms, when it has been
--                   asked to yield, else 0
--   ticket_results: one per ticket, in order:
--     {'q', position, ahead_bytes, amount, ahead_count}  still queued (expiry refreshed);
--                                                     ahead_bytes, amount, ahead_count as
--                                                     acquire.lua's
--     {'g', lease_id, token, expires_ms, amount, device}  granted (device 0 on a pool of one)
--     {'x'}                                           unknown (expired from the queue, cancelled)
--   queue: {capacity, used, held_back, queue_len, bytes_per_s, grants_per_ks, grace_left_ms,
--          out_of_order_pm}:
--     the rest of a queued waiter's estimate inputs (acquire.lua's; {} when the pool is not
--     configured)
-- Errors (nothing written): GPULOCK_BADARG <why>

local type_err = check_types(); if type_err then return type_err end
local n, e = int_arg(ARGV[1], 'n_leases', 0, 100000); if e then return e end
local leases = {}
local i = 2
for k = 1, n do
  local lid; lid, e = lease_id_arg(ARGV[i]); if e then return e end
  local tok; tok, e = int_arg(ARGV[i + 1], 'token', 0, MAX_AMOUNT); if e then return e end
  local ttl; ttl, e = int_arg(ARGV[i + 2], 'ttl_ms', MIN_TTL_MS, MAX_TTL_MS); if e then return e end
  leases[k] = {lid, tok, ttl}
  i = i + 3
end
local m; m, e = int_arg(ARGV[i], 'n_tickets', 0, 100000); if e then return e end
i = i + 1
local tickets = {}
for k = 1, m do
  local t; t, e = id_arg(ARGV[i], 'ticket'); if e then return e end
  local wttl; wttl, e = int_arg(ARGV[i + 1], 'waiter_ttl_ms', MIN_TTL_MS, MAX_TTL_MS); if e then return e end
  tickets[k] = {t, wttl}
  i = i + 2
end

-- First a write that can never grow memory (it deletes a field that never exists). With
-- maxmemory reached and no eviction, Redis refuses a write that may grow memory inside a script
-- only while the script has written nothing yet; after this one, the heartbeat can extend
-- leases and refresh waiters (neither needs new memory) when Redis is full, instead of every
-- holder losing its lease. It changes nothing, so nothing is replicated.
redis.call('HDEL', K_CFG, '-')

local now = now_ms()
local lres, tres = {}, {}
if redis.call('EXISTS', K_CFG) == 0 then
  for k = 1, n do lres[k] = 0 end
  for k = 1, m do tres[k] = {'x'} end
  return {now, 0, lres, tres, {}, lres}
end
reap(now)
publish(now, grant_head(now))

local yres = {}
for k, l in ipairs(leases) do
  lres[k], yres[k] = 0, 0
  local rec = redis.call('HGET', K_HOLDERS, l[1])
  if rec then
    local _, tok = parse_holder(rec)
    if tonumber(tok) == l[2] then
      local exp = now + l[3]
      local dl = yield_deadline(l[1])
      if dl then
        yres[k] = dl
        if exp > dl then exp = dl end
      end
      redis.call('ZADD', K_LEASES, 'XX', fmt(exp), l[1])
      lres[k] = exp
    end
  end
end
local last = 0  -- the latest position among the queued tickets: the bytes ahead are summed once
for k, tw in ipairs(tickets) do
  local t = tw[1]
  if redis.call('ZSCORE', K_QUEUE, t) then
    redis.call('ZADD', K_WEXP, fmt(now + tw[2]), t)
    local pos = redis.call('ZRANK', K_QUEUE, t) + 1
    local rec = redis.call('HGET', K_WAITERS, t)
    local a, tenant = 0, ''
    if rec then
      local x, _, _, _, _, _, _, tn = parse_waiter(rec)
      a, tenant = x or 0, tn or ''
    end
    tres[k] = {'q', pos, 0, a, 0, tenant}
    if pos > last then last = pos end
  else
    local lid = redis.call('HGET', K_TICKETS, t)
    if lid and redis.call('HEXISTS', K_HOLDERS, lid) == 1 then
      local g = grant_reply(now, lid)
      tres[k] = {'g', lid, g[3], g[4], g[5], g[10]}
    else
      tres[k] = {'x'}
    end
  end
end
if last > 0 then  -- the bytes and count ahead (lib.lua ahead_of), one walk for every ticket
  local w = ahead_walk(now, last - 1)
  for _, a in ipairs(tres) do
    if a[1] == 'q' then
      a[3], a[5] = ahead_of(w, a[2] - 1, a[4], a[6])
      a[6] = nil
    end
  end
end
local c = redis.call('HMGET', K_CFG, 'capacity', 'used', 'external', 'external_until')
local cap = tonumber(c[1] or '0')
local held_back = cap - eff_cap(now, cap, tonumber(c[3] or '0'), tonumber(c[4] or '0'))
local b, g, o = drain_rate()
return {now, cfg_num('epoch'), lres, tres,
        {cap, tonumber(c[2] or '0'), held_back, redis.call('ZCARD', K_QUEUE), b, g, grace_left(now), o},
        yres}
