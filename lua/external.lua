-- external.lua: the device sampler's claim and report (docs/SEMANTICS.md, "Device truth").
-- One sampler per pool (a pool is one device): the one whose id is in cfg `dev_sampler` until
-- `dev_sampler_until` (server ms). Others stand by and take over when its claim runs out.
-- KEYS: the eight pool keys described in lib.lua.
-- ARGV:
--   1 sampler_id    the sampler's id (1-128 chars of [A-Za-z0-9._:-])
--   2 claim_ms      how long the claim lasts without a renewal, milliseconds, 100 .. 86400000
--   3 mode          'claim' (take or extend the claim only) or 'report' (also publish 4-6;
--                   written only by the claim's holder)
--   4 external      bytes in use on the device outside the pool's leases, 0 .. capacity
--                   (the sampler caps it at the capacity: more grants nothing either way)
--   5 report_ms     how long the report counts, milliseconds, 100 .. 86400000: after
--                   external_until = now + report_ms it is ignored (the pool grants its full
--                   capacity again), so a sampler that dies cannot freeze the pool
--   6 overuse       the over-users the sampler found, JSON text (at most 4096 bytes; '' for
--                   none), kept as given for status; it expires with the report
-- Reply: {holder (1/0), written (1/0), now_ms, capacity, used, external, external_until, granted}
--   holder 0: another sampler holds the claim; nothing written. With mode 'report' and the
--   claim held, the report replaces the previous one and, if it frees room, the queue's head
--   is granted (the same hand-off as a release).
-- Errors (nothing written): GPULOCK_BADARG <why>, GPULOCK_NOPOOL

local type_err = check_types(); if type_err then return type_err end
local sid, e = id_arg(ARGV[1], 'sampler id'); if e then return e end
local claim_ms; claim_ms, e = int_arg(ARGV[2], 'claim_ms', MIN_TTL_MS, MAX_TTL_MS); if e then return e end
local mode = ARGV[3]
if mode ~= 'claim' and mode ~= 'report' then return bad("mode must be 'claim' or 'report', got " .. show(mode)) end
local cfg = redis.call('HMGET', K_CFG, 'capacity', 'dev_sampler', 'dev_sampler_until', 'used')
if not cfg[1] then return redis.error_reply('GPULOCK_NOPOOL') end
local cap = tonumber(cfg[1])
local external, report_ms, overuse
if mode == 'report' then
  external, e = int_arg(ARGV[4], 'external', 0, MAX_AMOUNT); if e then return e end
  if external > cap then
    return bad('external ' .. fmt(external) .. ' exceeds the capacity ' .. fmt(cap))
  end
  report_ms, e = int_arg(ARGV[5], 'report_ms', MIN_TTL_MS, MAX_TTL_MS); if e then return e end
  overuse = ARGV[6]
  if type(overuse) ~= 'string' or #overuse > 4096 then
    return bad('overuse must be JSON text of at most 4096 bytes, got ' .. show(overuse))
  end
  if overuse ~= '' then
    local ok, v = pcall(cjson.decode, overuse)
    if not ok or type(v) ~= 'table' then
      return bad('overuse must be a JSON array or object, got ' .. show(overuse))
    end
  end
end

-- Validation done; writes start here.
local now = now_ms()
local holder = cfg[2]
if holder and holder ~= sid and tonumber(cfg[3] or '0') > now then
  return {0, 0, now, cap, tonumber(cfg[4] or '0'), cfg_num('external'), cfg_num('external_until'), 0}
end
redis.call('HSET', K_CFG, 'dev_sampler', sid, 'dev_sampler_until', fmt(now + claim_ms))
if mode == 'claim' then
  return {1, 0, now, cap, tonumber(cfg[4] or '0'), cfg_num('external'), cfg_num('external_until'), 0}
end
redis.call('HSET', K_CFG, 'external', fmt(external), 'external_until', fmt(now + report_ms),
           'overuse', overuse)
reap(now)
local lines, n = grant_head(now)
publish(now, lines, n)
return {1, 1, now, cap, cfg_num('used'), external, now + report_ms, n}
