-- reap.lua: remove expired leases and dead waiters, then grant what now fits (FIFO).
-- Run by every waiting process when the nearest lease expiry passes, and by the service's
-- background reaper, so a crashed holder's bytes go to the next waiter right at its expiry.
-- KEYS: the eight pool keys described in lib.lua.
-- ARGV: none
-- Reply: {reaped_leases, reaped_waiters, granted, next_expiry_in_ms (-1: no lease), now_ms}
-- Errors: none (a pool without configuration has nothing to reap)

local type_err = check_types(); if type_err then return type_err end
local now = now_ms()
if redis.call('EXISTS', K_CFG) == 0 then return {0, 0, 0, -1, now} end
local nl, nw = reap(now)
local lines, n = grant_head(now)
publish(now, lines, n)
return {nl, nw, n, next_expiry_in(now), now}
