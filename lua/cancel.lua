-- cancel.lua: withdraw a request by ticket: leave the queue, or, when a grant raced in
-- before the cancel, release that grant. Either way the bytes go back at once.
-- KEYS: the eight pool keys described in lib.lua.
-- ARGV:
--   1 ticket   the request id given to acquire
-- Reply:
--   {0, now_ms}  the ticket was neither queued nor granted (nothing to do)
--   {1, now_ms}  the ticket left the queue
--   {2, now_ms}  the ticket had been granted; that lease was released
-- Errors (nothing written): GPULOCK_BADARG <why>

local type_err = check_types(); if type_err then return type_err end
local ticket, e = id_arg(ARGV[1], 'ticket'); if e then return e end

local now = now_ms()
if redis.call('EXISTS', K_CFG) == 0 then return {0, now} end
reap(now)
local what = 0
if redis.call('ZSCORE', K_QUEUE, ticket) then
  drop_waiter(ticket)
  what = 1
else
  local lid = redis.call('HGET', K_TICKETS, ticket)
  if lid and drop_lease(lid, true) then what = 2 end
end
publish(now, grant_head(now))
return {what, now}
