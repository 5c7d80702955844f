-- release.lua: end a lease and hand its bytes to the head of the queue (server-side hand-off).
-- KEYS: the eight pool keys described in lib.lua.
-- ARGV:
--   1 lease_id   32 hex digits
--   2 token      the lease's fencing token (decimal); the lease is released only if it matches
-- Reply:
--   {1, now_ms, used, granted}   released; `granted` waiters were handed bytes and notified
--   {0, now_ms, used, granted}   lost: no such live lease (expired and reaped, released before,
--                                never existed, or another token); nothing of others is freed
-- Errors (nothing written): GPULOCK_BADARG <why>

local lid, e = lease_id_arg(ARGV[1]); if e then return e end
local token; token, e = int_arg(ARGV[2], 'token', 0, MAX_AMOUNT); if e then return e end

local now = now_ms()
if redis.call('EXISTS', K_CFG) == 0 then return {0, now, 0, 0} end
reap(now)
local ok = 0
local rec = redis.call('HGET', K_HOLDERS, lid)
if rec then
  local _, tok = parse_holder(rec)
  if tonumber(tok) == token then
    drop_lease(lid)
    ok = 1
  end
end
local lines, n = grant_head(now)
publish(now, lines, n)
return {ok, now, cfg_num('used'), n}
