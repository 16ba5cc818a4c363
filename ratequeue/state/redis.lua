--[[
ratequeue's operations on one queue's record, each run atomically on the Redis server's clock.

The steps translate ratequeue/protocol.py, the reference every backend is held to (DESIGN.md §3).
The Python side, ratequeue/state/_redis_codec.py, packs the arguments and parses the reply.

One script serves every operation, chosen by ARGV[1], rather than one script per operation:
the record's reading and checks are written once (no script is assembled from shared pieces),
and there is one SHA to send and one SCRIPT LOAD after a NOSCRIPT (a restart, SCRIPT FLUSH).

KEYS[1]   the queue's hash: fields ticket, pos, at, interval, burst, due, each a whole number in
          decimal (a hash written before bursts lacks burst and due: burst is 1, due is at), and
          paused, "1" while the queue is paused for every shard and absent otherwise. A queue
          with a cap on running jobs (protocol.Record.max_running) also has max_running (absent:
          0, no cap), leases, its running jobs' leases in start order as "TICKET:EXPIRY" pairs
          joined by commas ("" or absent: none), and held, when a start was last refused for a
          full queue (absent: NEVER); a queue without a cap is written without these three
ARGV[1]   the operation: take, try_start, take_and_try, retime, set_paused, release, renew or
          read
ARGV[2]   the interval (us) the caller expects; a record created now gets it (read: ignored)
ARGV[3]   the burst the caller expects; a record created now gets it (read: ignored)
ARGV[4]   the keep time (us): every write with keep > 0 keeps the key until keep after the later
          of now and the record's expiry (protocol.expires), by a PEXPIRE relative to now; a write
          with keep 0, or leaving the record paused, PERSISTs the key, so it never expires (read:
          ignored)
ARGV[5]   the max_running the caller expects (0: no cap); a record created now gets it (read:
          ignored)
ARGV[6]   the lease (us) a start or a renewal takes, used only with max_running (read: ignored)
ARGV[7]   "" to read the server's TIME, or a fixed now (us) set by a test
ARGV[8..] the operation's own arguments, as its Python method takes them:
            take:              cost
            try_start:         ticket, lead (us), cost
            take_and_try:      lead (us), cost
            retime:            ticket, lead (us)
            set_paused:        1 to pause, 0 to resume
            release, renew:    ticket

The reply is one string of words separated by single spaces (the client parses one bulk string
in a fraction of the CPU an array of four or five items costs it); numbers are whole, in decimal:
  take                               "taken TICKET POS AT NOW"
  try_start, take_and_try, retime    "started TICKET START NOW", "wait TICKET SLOT NOW"
                                     or "passed TICKET POS NOW"
  set_paused                         "set CHANGED NOW", CHANGED 1 if the flag changed, else 0
  release, renew                     "live LIVE NOW", LIVE 1 if the ticket's lease was live, else 0
  read                               "record NOW TICKET POS AT INTERVAL BURST DUE PAUSED
                                     MAX_RUNNING HELD" (PAUSED 1 or 0) then each lease as
                                     "TICKET EXPIRY", or "none NOW"
and, changing nothing:
  any operation but read, when the stored interval is not ARGV[2]:   "mismatch interval INTERVAL"
  any operation but read, when the stored burst is not ARGV[3]:      "mismatch burst BURST"
  any operation but read, when the stored max_running is not ARGV[5]:
                                                                     "mismatch max_running MAX"
  any operation, when the stored record is malformed:                "corrupt FIELD VALUE"
  any operation, when `at` lies more than MAX_LEAD past now (no start the protocol grants
  does; see protocol.check):                                         "unwritten at AT NOW"
  take and take_and_try, when ticket + cost reaches LIMIT:           "unwritten ticket TICKET NOW"

take, try_start, take_and_try, retime, set_paused, release and renew create a missing record
(ticket 1, pos 0, at and due NEVER, not paused, with ARGV[2], ARGV[3] and ARGV[5], no leases)
and write the record back, all six fields and paused (set, or deleted if it was set), and with max_running
also max_running, leases and held (unless NEVER); read never writes. While the record is paused,
try_start (and the try of take_and_try) starts nothing: see protocol.try_start and
PAUSED_RECHECK. With max_running, a start takes a lease of ARGV[6] us, and while max_running
leases are live nothing starts: see protocol.try_start, FULL_RECHECK and FULL_GRACE.
Numbers stay below 2^53, so every one is exact in a double.
]]

-- ratequeue.protocol.NEVER, -2^52: the `at` of a record that has never started a job
local NEVER = -4503599627370496
-- ratequeue.state.base.MAX_US, 2^52: times and intervals stay below it, so every slot is exact
-- in a double
local LIMIT = 4503599627370496
-- ratequeue.protocol.MAX_LEAD_US, an hour: no start lies further ahead of the clock it was granted on
local MAX_LEAD = 3600000000
-- ratequeue.state.base.MAX_BURST, 2^31
local MAX_BURST = 2147483648
-- ratequeue.protocol.PAUSED_RECHECK_US, a second: a paused record answers wait at least this far ahead
local PAUSED_RECHECK = 1000000
-- ratequeue.protocol.FULL_RECHECK_US, 100 ms: a full queue answers wait at most this far ahead
local FULL_RECHECK = 100000
-- ratequeue.protocol.FULL_GRACE_US, 300 ms: for this long after a queue was found full, no
-- ticket passes an earlier one
local FULL_GRACE = 300000
-- ratequeue.protocol.MAX_RUNNING: the largest max_running
local MAX_RUNNING = 1000

local op = ARGV[1]

local now
if ARGV[7] == "" then
  local time = redis.call("TIME")
  now = tonumber(time[1]) * 1000000 + tonumber(time[2])
else
  now = tonumber(ARGV[7])
end

-- a whole number as the decimal text it is stored and answered as
local function decimal(value)
  return string.format("%.0f", value)
end

local FIELDS = {"ticket", "pos", "at", "interval", "burst", "due"}
local stored = redis.call("HMGET", KEYS[1], "ticket", "pos", "at", "interval", "burst", "due", "paused",
  "max_running", "leases", "held")
local ticket, pos, at, interval, burst, due
-- whether the queue is paused for every shard (the paused field, "1" or absent)
local paused = false
-- the cap on running jobs (0: none), the leases of running jobs as {ticket, expiry} pairs in
-- start order, and when a start was last refused because the queue was full
local max_running, leases, held = 0, {}, NEVER
if not (stored[1] or stored[2] or stored[3] or stored[4] or stored[5] or stored[6] or stored[7]
        or stored[8] or stored[9] or stored[10]) then
  if op == "read" then
    return "none " .. decimal(now)
  end
  ticket, pos, at, interval, burst, due = 1, 0, NEVER, tonumber(ARGV[2]), tonumber(ARGV[3]), NEVER
  max_running = tonumber(ARGV[5])
else
  local values = {}
  for i = 1, 6 do
    local text = stored[i]
    if text then
      if not string.find(text, "^%-?%d+$") then
        return "corrupt " .. FIELDS[i] .. " " .. text
      end
      values[i] = tonumber(text)
    elseif i <= 4 then
      return "corrupt " .. FIELDS[i] .. " (missing)"
    end
  end
  ticket, pos, at, interval = values[1], values[2], values[3], values[4]
  -- a record written before bursts lacks these two: burst 1, and due is at
  burst, due = values[5] or 1, values[6] or at
  if not (0 <= pos and pos < ticket and ticket < LIMIT and 0 < interval and interval < LIMIT
          and NEVER <= at and at < LIMIT) then
    return "corrupt ticket/pos/at/interval " .. table.concat(stored, "/", 1, 4)
  end
  if not (1 <= burst and burst <= MAX_BURST and burst * interval < LIMIT) then
    return "corrupt burst " .. tostring(stored[5])
  end
  if not (at <= due and due <= at + (burst - 1) * interval) then
    return "corrupt due " .. tostring(stored[6])
  end
  if stored[7] and stored[7] ~= "1" then
    return "corrupt paused " .. stored[7]
  end
  paused = stored[7] == "1"
  if stored[8] then
    if not string.find(stored[8], "^%d+$") then
      return "corrupt max_running " .. stored[8]
    end
    max_running = tonumber(stored[8])
    if max_running > MAX_RUNNING then
      return "corrupt max_running " .. stored[8]
    end
  end
  if stored[9] and stored[9] ~= "" then
    -- "TICKET:EXPIRY" pairs joined by commas: each item up to a comma (one is added at the end)
    for item in string.gmatch(stored[9] .. ",", "([^,]*),") do
      local t, expiry = string.match(item, "^(%d+):(%-?%d+)$")
      t, expiry = tonumber(t), tonumber(expiry)
      if not (t and expiry and 1 <= t and t < ticket and NEVER <= expiry and expiry < LIMIT
              and #leases < max_running) then
        return "corrupt leases " .. stored[9]
      end
      leases[#leases + 1] = {t, expiry}
    end
  end
  if stored[10] then
    if not string.find(stored[10], "^%-?%d+$") then
      return "corrupt held " .. stored[10]
    end
    held = tonumber(stored[10])
    if not (NEVER <= held and held < LIMIT) then
      return "corrupt held " .. stored[10]
    end
  end
  if op ~= "read" then
    if interval ~= tonumber(ARGV[2]) then
      return "mismatch interval " .. stored[4]
    end
    if burst ~= tonumber(ARGV[3]) then
      return "mismatch burst " .. decimal(burst)
    end
    if max_running ~= tonumber(ARGV[5]) then
      return "mismatch max_running " .. decimal(max_running)
    end
  end
  if at > now + MAX_LEAD then
    return "unwritten at " .. stored[3] .. " " .. decimal(now)
  end
  if op == "read" then
    local words = {"record", decimal(now), stored[1], stored[2], stored[3], stored[4],
      decimal(burst), decimal(due), paused and "1" or "0", decimal(max_running), decimal(held)}
    for _, lease in ipairs(leases) do
      words[#words + 1] = decimal(lease[1])
      words[#words + 1] = decimal(lease[2])
    end
    return table.concat(words, " ")
  end
end

-- the lease a start or a renewal takes (us), used only with max_running
local lease_us = tonumber(ARGV[6])

-- protocol.live_leases: the leases that have not expired at now, in start order
local function live_leases()
  local live = {}
  for _, lease in ipairs(leases) do
    if lease[2] > now then
      live[#live + 1] = lease
    end
  end
  return live
end

-- protocol.Record.slot: the strict slot of ticket t (> pos)
local function slot(t)
  return due + (t - pos) * interval
end

-- protocol.take: hand out the next ticket, holding `cost` numbers; first jump pos to the last one
-- handed out if every ticket since pos is at least one interval past its slot
local function take(cost)
  if ticket + cost >= LIMIT then
    return nil
  end
  local last = ticket - 1
  if last > pos and slot(last) + interval <= now and held + FULL_GRACE <= now then
    pos = last
  end
  ticket = ticket + cost
  return last + 1
end

-- protocol.try_start: start ticket t, of `cost`, if its earliest start is at most `lead` us away
local function try_start(t, lead, cost)
  if pos == t and t < ticket and now < at + interval then
    return "started", t, at -- the latest start asked for again (a lost reply): the same grant
  end
  if pos >= t or t >= ticket then
    return "passed", t, pos
  end
  local strict = slot(t)
  local earliest = math.max(strict - (burst - cost) * interval, at)
  if t > pos + 1 then -- it would pass the tickets between: not while they wait for a place
    earliest = math.max(earliest, held + FULL_GRACE)
  end
  if paused then
    return "wait", t, math.max(earliest, now + PAUSED_RECHECK) -- no start while paused
  end
  if now + lead < earliest then
    return "wait", t, earliest
  end
  if max_running > 0 then
    leases = live_leases()
    if #leases >= max_running then -- full: wait for the first lease's expiry, or recheck
      local recheck = now + FULL_RECHECK
      for _, lease in ipairs(leases) do
        recheck = math.min(recheck, lease[2])
      end
      held = now
      return "wait", t, math.max(earliest, recheck)
    end
  end
  local start = math.max(earliest, now)
  if max_running > 0 then
    leases[#leases + 1] = {t, start + lease_us}
  end
  pos, at, due = t, start, math.max(strict, start)
  return "started", t, start
end

-- protocol.retime: move the latest start to now + lead at the earliest, and due with it
local function retime(t, lead)
  if pos ~= t or t >= ticket then
    return "passed", t, pos
  end
  local start = math.max(at, now + lead)
  for _, lease in ipairs(leases) do -- the ticket's lease moves on by as much as its start
    if lease[1] == t then
      lease[2] = lease[2] + (start - at)
    end
  end
  at = start
  due = math.max(due, at)
  return "started", t, at
end

-- protocol.release: drop ticket t's lease and the expired ones; whether t's lease was live
local function release(t)
  local live = live_leases()
  local kept = {}
  for _, lease in ipairs(live) do
    if lease[1] ~= t then
      kept[#kept + 1] = lease
    end
  end
  leases = kept
  return #kept < #live
end

-- protocol.renew: make ticket t's lease last until now + lease_us at least, dropping the expired
-- ones; whether t's lease was live
local function renew(t)
  leases = live_leases()
  local found = false
  for _, lease in ipairs(leases) do
    if lease[1] == t then
      lease[2] = math.max(lease[2], now + lease_us)
      found = true
    end
  end
  return found
end

local reply
if op == "set_paused" then
  -- protocol.set_paused: only the flag changes
  local wanted = ARGV[8] == "1"
  reply = {"set", wanted ~= paused and "1" or "0", decimal(now)}
  paused = wanted
elseif op == "release" or op == "renew" then
  local live
  if op == "release" then
    live = release(tonumber(ARGV[8]))
  else
    live = renew(tonumber(ARGV[8]))
  end
  reply = {"live", live and "1" or "0", decimal(now)}
elseif op == "take" then
  local t = take(tonumber(ARGV[8]))
  if not t then
    return "unwritten ticket " .. decimal(ticket) .. " " .. decimal(now)
  end
  reply = {"taken", decimal(t), decimal(pos), decimal(at), decimal(now)}
else
  local kind, t, value
  if op == "try_start" then
    kind, t, value = try_start(tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10]))
  elseif op == "take_and_try" then
    local cost = tonumber(ARGV[9])
    t = take(cost)
    if not t then
      return "unwritten ticket " .. decimal(ticket) .. " " .. decimal(now)
    end
    kind, t, value = try_start(t, tonumber(ARGV[8]), cost)
  elseif op == "retime" then
    kind, t, value = retime(tonumber(ARGV[8]), tonumber(ARGV[9]))
  else
    return redis.error_reply("ratequeue: unknown operation " .. tostring(op))
  end
  reply = {kind, decimal(t), decimal(value), decimal(now)}
end

local fields = {"ticket", decimal(ticket), "pos", decimal(pos), "at", decimal(at),
  "interval", decimal(interval), "burst", decimal(burst), "due", decimal(due)}
-- the latest of protocol.expires: the slot of the next ticket plus an interval, then (with
-- max_running) the end of the grace after the queue was last found full, and every lease's expiry
local expires = slot(ticket) + interval
if max_running > 0 then -- a queue without a cap is written as before leases
  local pairs_text = {}
  for i, lease in ipairs(leases) do
    pairs_text[i] = decimal(lease[1]) .. ":" .. decimal(lease[2])
    expires = math.max(expires, lease[2])
  end
  table.insert(fields, "max_running")
  table.insert(fields, decimal(max_running))
  table.insert(fields, "leases")
  table.insert(fields, table.concat(pairs_text, ","))
  if held ~= NEVER then
    table.insert(fields, "held")
    table.insert(fields, decimal(held))
  end
end
expires = math.max(expires, held + FULL_GRACE)
redis.call("HSET", KEYS[1], unpack(fields))
if paused then
  redis.call("HSET", KEYS[1], "paused", "1")
elseif stored[7] then -- resumed: the flag goes (a record never paused has none to delete)
  redis.call("HDEL", KEYS[1], "paused")
end

-- the keep time: until keep after the later of now and protocol.expires (see expires above), in
-- whole milliseconds, rounded up, relative to now
local keep = tonumber(ARGV[4])
if keep > 0 and not paused then -- a paused record is kept until resumed (protocol.set_paused)
  -- (at most LIMIT us, some 142 years: a longer span is as good as forever, and stays exact)
  local span = math.min(math.max(expires, now) + keep - now, LIMIT)
  local ms = math.floor(span / 1000)
  while ms * 1000 < span do
    ms = ms + 1
  end
  while ms > 1 and (ms - 1) * 1000 >= span do
    ms = ms - 1
  end
  redis.call("PEXPIRE", KEYS[1], decimal(ms))
else
  redis.call("PERSIST", KEYS[1])
end
return table.concat(reply, " ")
