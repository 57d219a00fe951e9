-- Loom quota admission: one atomic script call per operation on one tenant.
--
-- Every key belongs to one tenant and carries its hash tag, so a Redis Cluster runs the call on one
-- node. Time is the Redis server's (TIME), never a gateway's clock. The Python twin of these rules
-- is tenancy/quota_math.py + tenancy/admission_local.py; the tests run one suite against both.
--
-- KEYS[1] state   hash: rpm_level rpm_ts tpm_level tpm_ts day day_used month month_used
-- KEYS[2] leases  zset: request id -> lease expiry (microseconds)
-- KEYS[3] request hash: state(running|done) reserved prompt day month completion [outcome]
--         (sweep: the request-key prefix `<p>:t:{T}:req:` itself)
-- KEYS[4] usage   hash: "YYYY-MM-DD|requests|prompt_tokens|completion_tokens|cancelled|errors|expired" -> n
-- ARGV[1] operation: admit | renew | finish | sweep | civil;  ARGV[2] request id ('' for sweep)
--
-- Lapsed leases are settled here, exactly once: the first call that finds a lease whose expiry has
-- passed (an admit, renew or finish of the tenant, or a sweep) closes its request as a finish with
-- the completion tokens of its last renewal and outcome 'expired' (close() below, the same code
-- finish runs). The record of request R is KEYS[3]'s prefix .. R: a key of the same tenant, so of
-- the same hash tag and slot, derived rather than declared.
--
-- Numbers sent back to redis.call are formatted explicitly: Lua's default number-to-string keeps
-- only 14 significant digits, which would round microsecond timestamps.

local MINUTE = 60000000
local DAY = 86400000000
local EPSILON = 1e-9

local function int(x) return string.format('%.0f', x) end
local function num(x) return string.format('%.17g', x) end

local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- Proleptic Gregorian calendar <-> days since 1970-01-01 (H. Hinnant's algorithms).
local function civil(days)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m, d
end

local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = (m + 9) % 12
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

local function day_label(day)
  local y, m, d = civil(day)
  return string.format('%04d-%02d-%02d', y, m, d)
end

local function month_of(day)
  local y, m = civil(day)
  return y * 12 + m - 1
end

local function next_month_start_us(day)
  local y, m = civil(day)
  if m == 12 then y, m = y + 1, 1 else m = m + 1 end
  return days_from_civil(y, m, 1) * DAY
end

-- Token bucket of capacity `limit`, refilled at `limit` per minute. A missing bucket is full.
local function refill(level, ts, limit, now)
  if level == nil or ts == nil then return limit, now end
  if now > ts then
    level = math.min(limit, level + (now - ts) * limit / MINUTE)
    ts = now
  elseif level > limit then
    level = limit
  end
  return level, ts
end

-- 0: fits now; n > 0: microseconds to wait; -1: never fits.
local function bucket_wait(level, limit, cost)
  if cost > limit then return -1 end
  local missing = cost - level
  if missing <= EPSILON then return 0 end
  return math.ceil(missing * MINUTE / limit)
end

local function budget_wait(budget, used, cost, period_end, now)
  if cost > budget then return -1 end
  if used + cost <= budget then return 0 end
  return math.max(1, period_end - now)
end

local function extend_ttl(key, ms)
  if redis.call('PTTL', key) < ms then redis.call('PEXPIRE', key, int(ms)) end
end

local op = ARGV[1]
local RID = ARGV[2] or ''
local REQ_PREFIX = string.sub(KEYS[3], 1, #KEYS[3] - #RID)
local REC_FIELDS = {'state', 'reserved', 'prompt', 'day', 'month', 'completion', 'outcome'}

local function live_leases(now)
  return redis.call('ZCOUNT', KEYS[2], '(' .. int(now), '+inf')
end

local function meter(today, prompt, completion, outcome, retention_days)
  local label = day_label(today)
  redis.call('HINCRBY', KEYS[4], label .. '|requests', 1)
  redis.call('HINCRBY', KEYS[4], label .. '|prompt_tokens', int(prompt))
  redis.call('HINCRBY', KEYS[4], label .. '|completion_tokens', int(completion))
  if outcome == 'cancelled' then
    redis.call('HINCRBY', KEYS[4], label .. '|cancelled', 1)
  elseif outcome == 'error' then
    redis.call('HINCRBY', KEYS[4], label .. '|errors', 1)
  elseif outcome == 'expired' then
    redis.call('HINCRBY', KEYS[4], label .. '|expired', 1)
  end
  if redis.call('HGET', KEYS[4], 'last_day') ~= label then
    -- First request of a new day: drop days past retention (bounded work, once per day).
    local cutoff = day_label(today - retention_days)
    for _, field in ipairs(redis.call('HKEYS', KEYS[4])) do
      if field ~= 'last_day' and string.sub(field, 1, 10) < cutoff then redis.call('HDEL', KEYS[4], field) end
    end
    redis.call('HSET', KEYS[4], 'last_day', label)
  end
end

-- End one request: correct its reservation to prompt + completion in the periods it was charged to
-- (and tokens/min), meter usage, drop its lease, mark it done. finish and settlement both end here.
-- r: the record's REC_FIELDS. Returns the refund (negative: charged beyond the reservation).
local function close(req, rid, r, prompt, completion, outcome, tpm, orphan, now, p)
  local today = math.floor(now / DAY)
  local actual = prompt + completion
  local refund = 0
  local s = redis.call('HMGET', KEYS[1], 'tpm_level', 'tpm_ts', 'day', 'day_used', 'month', 'month_used')
  if r[1] == 'running' then
    local delta = actual - tonumber(r[2])
    refund = -delta
    if tpm >= 0 and s[1] then
      local level, ts = refill(tonumber(s[1]), tonumber(s[2]), tpm, now)
      level = math.min(tpm, level - delta)
      redis.call('HSET', KEYS[1], 'tpm_level', num(level), 'tpm_ts', int(ts))
    end
    if s[3] == r[4] and s[4] then
      redis.call('HSET', KEYS[1], 'day_used', int(math.max(0, tonumber(s[4]) + delta)))
    end
    if s[5] == r[5] and s[6] then
      redis.call('HSET', KEYS[1], 'month_used', int(math.max(0, tonumber(s[6]) + delta)))
    end
    redis.call('PEXPIRE', KEYS[1], int(p.state_ttl_ms))
  elseif orphan then
    -- Admitted by a gateway's local limiter while Redis was unreachable: charge the budgets now.
    local this_month = month_of(today)
    local day_used, month_used = actual, actual
    if tonumber(s[3]) == today then day_used = (tonumber(s[4]) or 0) + actual end
    if tonumber(s[5]) == this_month then month_used = (tonumber(s[6]) or 0) + actual end
    redis.call('HSET', KEYS[1], 'day', int(today), 'day_used', int(day_used),
               'month', int(this_month), 'month_used', int(month_used))
    redis.call('PEXPIRE', KEYS[1], int(p.state_ttl_ms))
  end
  -- (No record and not an orphan: the record outlived its TTL; usage is still metered below.)
  meter(today, prompt, completion, outcome, p.retention_days)
  redis.call('ZREM', KEYS[2], rid)
  redis.call('HSET', req, 'state', 'done', 'completion', int(completion), 'outcome', outcome)
  redis.call('PEXPIRE', req, int(p.done_ttl_ms))
  return refund
end

-- Settle up to max_n lapsed leases (expiry <= now) other than `except`. Returns {settled, more}:
-- more = 1 when lapsed leases remain for a later call.
local function settle_lapsed(now, max_n, except, tpm, p)
  local due = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', int(now), 'LIMIT', 0, max_n + 2)
  local n, more = 0, 0
  for _, rid in ipairs(due) do
    if rid ~= except then
      if n >= max_n then more = 1; break end
      local req = REQ_PREFIX .. rid
      local r = redis.call('HMGET', req, unpack(REC_FIELDS))
      if r[1] == 'running' then
        close(req, rid, r, tonumber(r[3] or 0), tonumber(r[6] or 0), 'expired', tpm, false, now, p)
        n = n + 1
      else
        redis.call('ZREM', KEYS[2], rid)  -- no running record behind it: nothing to settle
      end
    end
  end
  return {n, more}
end

if op == 'admit' then
  local rpm, tpm, conc = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
  local dbud, mbud = tonumber(ARGV[6]), tonumber(ARGV[7])
  local prompt, max_tokens = tonumber(ARGV[8]), tonumber(ARGV[9])
  local lease_ttl, conc_hint = tonumber(ARGV[10]), tonumber(ARGV[11])
  local p = {state_ttl_ms = tonumber(ARGV[12]), done_ttl_ms = tonumber(ARGV[13]),
             retention_days = tonumber(ARGV[14])}
  local settle_max = tonumber(ARGV[15])
  local cost = prompt + max_tokens
  local now = now_us()

  -- Lapsed leases first: their refunds count for this admission.
  settle_lapsed(now, settle_max, nil, tpm, p)

  local s = redis.call('HMGET', KEYS[1], 'rpm_level', 'rpm_ts', 'tpm_level', 'tpm_ts',
                       'day', 'day_used', 'month', 'month_used')
  local today = math.floor(now / DAY)
  local this_month = month_of(today)
  local day_used, month_used = 0, 0
  if tonumber(s[5]) == today then day_used = tonumber(s[6]) or 0 end
  if tonumber(s[7]) == this_month then month_used = tonumber(s[8]) or 0 end

  -- Idempotency: the same request id admitted twice gets its first answer back.
  local rec = redis.call('HMGET', KEYS[3], 'state', 'reserved', 'prompt')
  if rec[1] == 'running' then
    local exp = redis.call('ZSCORE', KEYS[2], RID)
    return {1, 'dup', tonumber(exp or 0), tonumber(rec[2] or 0), day_used, month_used, tonumber(rec[3] or 0)}
  elseif rec[1] then
    return {0, 'duplicate_request', -1, day_used, month_used}
  end

  -- Check every limit without changing anything; remember the one that needs the longest wait.
  local worst, worst_wait = nil, 0
  local function consider(name, wait)
    if wait == 0 or worst_wait == -1 then return end
    if wait == -1 or wait > worst_wait then worst, worst_wait = name, wait end
  end

  local rpm_level, rpm_ts, tpm_level, tpm_ts
  if rpm >= 0 then
    rpm_level, rpm_ts = refill(tonumber(s[1]), tonumber(s[2]), rpm, now)
    consider('requests_per_minute', bucket_wait(rpm_level, rpm, 1))
  end
  if tpm >= 0 then
    tpm_level, tpm_ts = refill(tonumber(s[3]), tonumber(s[4]), tpm, now)
    consider('tokens_per_minute', bucket_wait(tpm_level, tpm, cost))
  end
  if dbud >= 0 then
    consider('daily_token_budget', budget_wait(dbud, day_used, cost, (today + 1) * DAY, now))
  end
  if mbud >= 0 then
    consider('monthly_token_budget', budget_wait(mbud, month_used, cost, next_month_start_us(today), now))
  end
  -- Lapsed leases never count, settled yet or not (settlement is bounded per call).
  if conc >= 0 and live_leases(now) >= conc then
    local first = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. int(now), '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    local wait = conc_hint
    if first[2] then wait = math.min(conc_hint, math.max(1, tonumber(first[2]) - now)) end
    consider('max_concurrent', wait)
  end

  -- The rate buckets' levels travel back as text (Lua numbers become integers in a reply), empty
  -- for a limit not set: a gateway that loses Redis starts its local buckets from them.
  local function level(x) if x == nil then return '' end return tostring(x) end
  if worst then
    return {0, worst, worst_wait, day_used, month_used, level(rpm_level), level(tpm_level)}
  end

  -- All limits pass: reserve everything.
  day_used = day_used + cost
  month_used = month_used + cost
  local fields = {'day', int(today), 'day_used', int(day_used), 'month', int(this_month), 'month_used', int(month_used)}
  if rpm >= 0 then
    table.insert(fields, 'rpm_level'); table.insert(fields, num(rpm_level - 1))
    table.insert(fields, 'rpm_ts'); table.insert(fields, int(rpm_ts))
  end
  if tpm >= 0 then
    table.insert(fields, 'tpm_level'); table.insert(fields, num(tpm_level - cost))
    table.insert(fields, 'tpm_ts'); table.insert(fields, int(tpm_ts))
  end
  redis.call('HSET', KEYS[1], unpack(fields))
  redis.call('PEXPIRE', KEYS[1], int(p.state_ttl_ms))
  local expiry = now + lease_ttl
  redis.call('ZADD', KEYS[2], int(expiry), RID)
  -- The lease set and a running record live as long as the budgets they may have to refund: a lapsed
  -- lease is settled whenever it is noticed, however late.
  extend_ttl(KEYS[2], p.state_ttl_ms)
  redis.call('HSET', KEYS[3], 'state', 'running', 'reserved', int(cost), 'prompt', int(prompt),
             'day', int(today), 'month', int(this_month), 'completion', 0)
  redis.call('PEXPIRE', KEYS[3], int(p.state_ttl_ms))
  local rpm_left, tpm_left
  if rpm >= 0 then rpm_left = rpm_level - 1 end
  if tpm >= 0 then tpm_left = tpm_level - cost end
  return {1, 'ok', expiry, cost, day_used, month_used, prompt, level(rpm_left), level(tpm_left)}

elseif op == 'renew' then
  local conc, lease_ttl, completion = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
  local tpm = tonumber(ARGV[6])
  local p = {state_ttl_ms = tonumber(ARGV[7]), done_ttl_ms = tonumber(ARGV[8]),
             retention_days = tonumber(ARGV[9])}
  local settle_max = tonumber(ARGV[10])
  local now = now_us()
  local r = redis.call('HMGET', KEYS[3], unpack(REC_FIELDS))
  if not r[1] then return {0, 'unknown', 0} end
  if r[1] ~= 'running' then
    if r[7] == 'expired' then return {0, 'lost', 0} end
    return {0, 'finished', 0}
  end
  if completion >= 0 then
    redis.call('HSET', KEYS[3], 'completion', int(completion))
    r[6] = int(completion)
  end
  -- Other lapsed leases are settled; ours is decided below (a holder back in time may keep it).
  settle_lapsed(now, settle_max, RID, tpm, p)
  local tag = 'ok'
  local current = redis.call('ZSCORE', KEYS[2], RID)
  if (not current) or tonumber(current) <= now then
    -- Our lease lapsed (a long pause) and nobody settled it yet. Take a slot again only if one is
    -- free; else the request is over: settled now with what this renewal reports.
    redis.call('ZREM', KEYS[2], RID)
    if conc >= 0 and live_leases(now) >= conc then
      close(KEYS[3], RID, r, tonumber(r[3] or 0), tonumber(r[6] or 0), 'expired', tpm, false, now, p)
      return {0, 'lost', 0}
    end
    tag = 'reacquired'
  end
  local expiry = now + lease_ttl
  redis.call('ZADD', KEYS[2], int(expiry), RID)
  extend_ttl(KEYS[2], p.state_ttl_ms)
  redis.call('PEXPIRE', KEYS[3], int(p.state_ttl_ms))
  return {1, tag, expiry}

elseif op == 'finish' then
  local completion, prompt_arg, outcome = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
  local tpm = tonumber(ARGV[6])
  local p = {done_ttl_ms = tonumber(ARGV[7]), retention_days = tonumber(ARGV[8]),
             state_ttl_ms = tonumber(ARGV[10])}
  local orphan, settle_max = ARGV[9] == '1', tonumber(ARGV[11])
  local now = now_us()

  local r = redis.call('HMGET', KEYS[3], unpack(REC_FIELDS))
  if r[1] == 'done' then return {0, 'duplicate', 0} end
  local prompt = prompt_arg
  if prompt < 0 then prompt = tonumber(r[3] or 0) end
  local refund = close(KEYS[3], RID, r, prompt, completion, outcome, tpm, orphan, now, p)
  settle_lapsed(now, settle_max, RID, tpm, p)
  return {1, 'ok', refund}

elseif op == 'sweep' then
  -- Settle the tenant's lapsed leases (bounded); run periodically so that idle tenants are settled.
  local tpm = tonumber(ARGV[3])
  local p = {state_ttl_ms = tonumber(ARGV[4]), done_ttl_ms = tonumber(ARGV[5]),
             retention_days = tonumber(ARGV[6])}
  return settle_lapsed(now_us(), tonumber(ARGV[7]), nil, tpm, p)

elseif op == 'civil' then
  -- Calendar self-check for the tests: day index -> y, m, d, round trip, next month start (days).
  local day = tonumber(ARGV[2])
  local y, m, d = civil(day)
  return {y, m, d, days_from_civil(y, m, d), next_month_start_us(day) / DAY, month_of(day)}
end

return redis.error_reply('unknown admission operation: ' .. tostring(op))
