-- Loom admin change: one atomic script per change to the tenant config (all KEYS in the {cfg} slot).
-- Bumps the global revision, stores the change, appends it to the audit stream and announces it.
--
-- KEYS[1] config version  KEYS[2] tenant versions hash  KEYS[3] tenant record  KEYS[4] tenant's keys hash
-- KEYS[5] key index hash  KEYS[6] audit stream
-- ARGV[1] op: put_tenant | delete_tenant | put_key
-- ARGV[2] tenant id   ARGV[3] expectation: absent | present | <tenant version>
-- ARGV[4] tenant JSON (put_tenant) or key id (put_key)   ARGV[5] key JSON (put_key)
-- ARGV[6] actor  ARGV[7] action  ARGV[8] changes JSON  ARGV[9] audit max length  ARGV[10] channel
-- ARGV[11] key id for the audit entry ('' if none)
-- Returns {1, 'ok', version} or {0, 'exists'|'missing'|'conflict', current version}.

local op, tid, expect = ARGV[1], ARGV[2], ARGV[3]
local exists = redis.call('EXISTS', KEYS[3]) == 1
local current = tonumber(redis.call('HGET', KEYS[2], tid) or '0')

if expect == 'absent' then
  if exists then return {0, 'exists', current} end
elseif expect == 'present' then
  if not exists then return {0, 'missing', current} end
else
  if not exists then return {0, 'missing', current} end
  if current ~= tonumber(expect) then return {0, 'conflict', current} end
end

local version = redis.call('INCR', KEYS[1])
if op == 'put_tenant' then
  redis.call('SET', KEYS[3], ARGV[4])
  redis.call('HSET', KEYS[2], tid, version)
elseif op == 'delete_tenant' then
  for _, kid in ipairs(redis.call('HKEYS', KEYS[4])) do redis.call('HDEL', KEYS[5], kid) end
  redis.call('DEL', KEYS[3], KEYS[4])
  redis.call('HDEL', KEYS[2], tid)
elseif op == 'put_key' then
  redis.call('HSET', KEYS[4], ARGV[4], ARGV[5])
  redis.call('HSET', KEYS[5], ARGV[4], tid)
  redis.call('HSET', KEYS[2], tid, version)
else
  return redis.error_reply('unknown config operation: ' .. tostring(op))
end

redis.call('XADD', KEYS[6], 'MAXLEN', '~', ARGV[9], '*',
           'actor', ARGV[6], 'action', ARGV[7], 'tenant', tid, 'key_id', ARGV[11],
           'version', version, 'changes', ARGV[8])
redis.call('PUBLISH', ARGV[10], cjson.encode({tenant = tid, version = version, op = op}))
return {1, 'ok', version}
