--[[
ratequeue's operations on one queue's record, each run atomically on the Redis server's clock.

The steps translate ratequeue/core/protocol.py, the reference every state is held to
(docs/design.md). The Python side, codec.py beside this file, packs the arguments and parses
the reply. One script serves every operation, chosen by ARGV[1]: the record's reading and checks
are written once, and there is one SHA to send and one SCRIPT LOAD after a NOSCRIPT.

KEYS[1]   the queue's hash, with every field of protocol.Record, each a whole number in decimal:
          ticket, pos, at, interval, due, burst, paused ("1" or "0"), max_running ("0": no cap),
          held, and leases, the running jobs' leases in start order as "TICKET:EXPIRY:TOKEN"
          joined by commas ("" for none); and not_before, pace, paced_at and settled, each present
          only while it is not its default (NEVER, 0, NEVER, 0; records written before they were
          added lack them: missing is the default); paused_at, when the pause began, present only
          while paused (missing: NEVER, as in a record paused before it was added; on a record
          not paused it is ignored, whatever it holds, as an older version's resume leaves it, and
          the next write deletes it); and in a fair queue's record only
          (protocol.enqueue), fair ("1"), number, begun and waiters, a JSON array of [number,
          tenant, weight, cost, ticket] (a record without fair is not fair, and stores none of them)
ARGV[1]   the operation (core/operation.py's Kind), or read
ARGV[2]   the interval (us) the caller expects; a record created now gets it (read: ignored)
ARGV[3]   the burst the caller expects; likewise
ARGV[4]   the keep time (us): a write with keep > 0 keeps the key until keep after the later of
          now and the record's expiry (protocol.expires), by a PEXPIRE relative to now; a write
          with keep 0, or leaving the record paused, PERSISTs the key
ARGV[5]   the max_running the caller expects (0: no cap); a record created now gets it
ARGV[6]   the lease (us) a start or a renewal takes, used with max_running only
ARGV[7]   "" to read the server's TIME, or a fixed now (us) set by a test
ARGV[8]   the ticket (try_start, retime, release, renew, settle)
ARGV[9]   the lead (us) (try_start, take_and_try, try_take, retime, hold); slow: the interval (us)
          to slow to at least (0: twice the effective one); settle: not a time, the job's actual
          cost (0 to the burst)
ARGV[10]  the cost (take, try_start, take_and_try, try_take); settle: the cost the ticket was
          taken for
ARGV[11]  set_paused: 1 to pause, 0 to resume
ARGV[12]  the token naming the ticket's lease (try_start, take_and_try, try_take, release, renew;
          0: none)
ARGV[13]  the doubt (us) a new start adds to due (try_start, take_and_try, try_take, retime; 0 to
          MAX_DOUBT)
ARGV[14]  "1" when the caller expects a fair queue (a record created now is fair); absent: not fair
ARGV[15]  with ARGV[14]: the waiter's weight (take, take_and_try, try_take; 1 to MAX_WEIGHT)
ARGV[16]  with ARGV[14]: the waiter's tenant (take, take_and_try, try_take), as UTF-8 text

On a fair record take, try_start and take_and_try are protocol.enqueue, try_turn and
enqueue_and_try: their TICKET is a waiter's number, but in a started answer (the ticket started).
try_take (protocol.try_take) is take_and_try (on a fair record enqueue_and_try) that writes
nothing unless it starts: its wait answer names the ticket (or waiter number) not taken.

The reply is one string of words separated by single spaces (a client parses one bulk string in
a fraction of the CPU an array costs it); numbers are whole, in decimal:
  take                               "taken TICKET POS AT NOW"
  try_start, take_and_try,           "started TICKET START NOW", "wait TICKET SLOT NOW"
  try_take, retime                   or "passed TICKET POS NOW"
  set_paused                         "set CHANGED NOW", CHANGED 1 if the flag changed, else 0
  hold                               "set CHANGED NOW", CHANGED 1 if the hold moved, else 0
  lift                               "set CHANGED NOW", CHANGED 1 if a hold was on at NOW, else 0
  slow                               "set CHANGED NOW", CHANGED 1 if it slowed the queue, else 0
  settle                             "set CHANGED NOW", CHANGED 1 if the schedule (due) moved,
                                     else 0
  release, renew                     "live LIVE NOW", LIVE 1 if the ticket's lease was live, else 0
  read                               "record NOW TICKET POS AT INTERVAL BURST DUE PAUSED
                                     MAX_RUNNING HELD NOT_BEFORE PACE PACED_AT SETTLED PAUSED_AT"
                                     then each lease as "TICKET EXPIRY TOKEN", and for a fair
                                     record a newline, then "NUMBER BEGUN WAITERS" (WAITERS the
                                     stored JSON array); or "none NOW"
and, changing nothing:
  any operation but read, when a stored term is not the caller's:    "mismatch FIELD VALUE"
                                                                     (interval, burst, max_running,
                                                                     fair: 1 or 0)
  any operation, when the stored record is malformed:                "corrupt FIELD VALUE"
  any operation, when `at`, `held`, `paced_at` or `paused_at` lies more than MAX_LEAD past now,
  `not_before` more than MAX_LEAD + MAX_HOLD, or a lease's expiry more than MAX_LEAD + MAX_LEASE
  (no start, now, hold or lease the protocol makes does; see protocol.check):
                                                                     "unwritten FIELD VALUE NOW"
  take, take_and_try and try_take, when ticket + cost reaches LIMIT: "unwritten ticket TICKET NOW"
  (on a fair record, any of them that hands a waiter a ticket; and take, take_and_try and
  try_take, when number + 1 reaches LIMIT:                           "unwritten number NUMBER NOW")

While a record was found full within FULL_GRACE (held + FULL_GRACE > now), a release that frees
a live lease, and a start that leaves a place free (the next ticket, held back by the grace, may
take it), also PUBLISH an empty message on the channel KEYS[1] .. "#freed", which the shards of
other processes waiting for a place listen on (freed.py); nothing else publishes.

Every operation but read creates a missing record (protocol.new_record) and writes the whole
record back (not_before, pace, paced_at, settled and paused_at removed from the hash when they
are their default), its keep time set (ARGV[4]); try_take only when it answers started
(otherwise the hash and its TTL are left as they were); read never writes. Numbers stay below
2^53, so every one is exact in a double.
]]

-- the constants of core/protocol.py (tests/test_constants.py holds them equal)
local NEVER = -4503599627370496   -- NEVER, -2^52: the `at` of a record that has never started
local LIMIT = 4503599627370496    -- MAX_US, 2^52: times, intervals and tickets stay below it
local MAX_LEAD = 3600000000       -- MAX_LEAD_US: no start lies further past the now it was made at
local MAX_BURST = 2147483648      -- MAX_BURST, 2^31
local PAUSED_RECHECK = 1000000    -- PAUSED_RECHECK_US: a paused record answers wait this far ahead
local FULL_RECHECK = 100000       -- FULL_RECHECK_US: a full record answers wait at most this far ahead
local FULL_GRACE = 300000         -- FULL_GRACE_US: after a record was full, no ticket passes another
local MAX_RUNNING = 1000          -- MAX_RUNNING: the largest max_running
local MAX_LEASE = 86400000000     -- MAX_LEASE_US: no lease expires further past the now it was taken at
local MAX_HOLD = 86400000000      -- MAX_HOLD_US: no hold ends further past the now it was set at
local MAX_DOUBT = 100000          -- MAX_DOUBT_US: a start moves due at most this far for its doubt
local MAX_WEIGHT = 1000           -- operation.MAX_WEIGHT: the largest weight of a fair queue's tenant
local MAX_SLOW = 64               -- MAX_SLOW: a slow-down's pace is at most this many intervals
local RECOVER = 5000000           -- RECOVER_US: a slow-down's excess halves this often

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

local FIELDS = {"ticket", "pos", "at", "interval", "due", "burst", "max_running", "held", "paused",
  "leases", "not_before", "pace", "paced_at", "settled", "paused_at", "fair", "number", "begun",
  "waiters"}
-- (a fair record's own number, begun and waiters are read below, only when fair is stored)
local stored = redis.call("HMGET", KEYS[1], unpack(FIELDS, 1, 16))
local ticket, pos, at, interval, due, burst, max_running, held
-- no ticket starts before this time (protocol.hold); NEVER: no hold (also when the hash lacks it)
local not_before = NEVER
-- the interval the last slow-down set (protocol.slow), and when; 0 and NEVER: none (also when
-- the hash lacks them)
local pace, paced_at = 0, NEVER
-- the ticket of the latest settlement that moved due (protocol.settle); 0: none (also when the
-- hash lacks it)
local settled = 0
-- whether the queue is paused for every shard
local paused = false
-- when the pause began (protocol.set_paused); NEVER while not paused (also when the hash lacks it:
-- a record not paused, or paused by a version that did not store it)
local paused_at = NEVER
-- the leases of running jobs as {ticket, expiry, token} in start order
local leases = {}
-- a fair queue's fields (protocol.enqueue): whether the record is fair, the next waiter number, the
-- number of the waiter that started last (0: none), and the waiters as {number, tenant, weight,
-- cost, ticket} in the order they came (ticket 0: none yet)
local fair, number, begun, waiters = false, 1, 0, {}

-- the waiters as stored: a JSON array of [number, tenant, weight, cost, ticket], the numbers in
-- decimal (cjson would write large ones as 1e+15), each tenant as cjson writes a string
local function waiters_text()
  local items = {}
  for i, w in ipairs(waiters) do
    items[i] = "[" .. decimal(w[1]) .. "," .. cjson.encode(w[2]) .. "," .. decimal(w[3]) .. ","
      .. decimal(w[4]) .. "," .. decimal(w[5]) .. "]"
  end
  return "[" .. table.concat(items, ",") .. "]"
end
-- the slowest pace a slow-down may set (protocol.slow): MAX_SLOW intervals, and burst of them
-- below LIMIT; (LIMIT - 1) // burst, corrected should the quotient round up
local function slowest_pace()
  local most = math.floor((LIMIT - 1) / burst)
  while most * burst > LIMIT - 1 do
    most = most - 1
  end
  return math.min(MAX_SLOW * interval, most)
end

if not (stored[1] or stored[2] or stored[3] or stored[4] or stored[5] or stored[6] or stored[7]
        or stored[8] or stored[9] or stored[10] or stored[11] or stored[12] or stored[13]
        or stored[14] or stored[15] or stored[16]) then
  if op == "read" then
    return "none " .. decimal(now)
  end
  ticket, pos, at, interval, due, burst = 1, 0, NEVER, tonumber(ARGV[2]), NEVER, tonumber(ARGV[3])
  max_running, held = tonumber(ARGV[5]), NEVER
  fair = ARGV[14] == "1"
else
  local values = {}
  for i = 1, 8 do
    local text = stored[i]
    if not text then
      return "corrupt " .. FIELDS[i] .. " (missing)"
    end
    if not string.find(text, "^%-?%d+$") then
      return "corrupt " .. FIELDS[i] .. " " .. text
    end
    values[i] = tonumber(text)
  end
  ticket, pos, at, interval, due, burst, max_running, held = unpack(values)
  if not (0 <= pos and pos < ticket and ticket < LIMIT and 0 < interval and interval < LIMIT
          and NEVER <= at and at < LIMIT) then
    return "corrupt ticket/pos/at/interval " .. table.concat(stored, "/", 1, 4)
  end
  if not (1 <= burst and burst <= MAX_BURST and burst * interval < LIMIT) then
    return "corrupt burst " .. stored[6]
  end
  if stored[12] then -- (a record written before the slow-down was added lacks it: 0)
    pace = string.find(stored[12], "^%d+$") and tonumber(stored[12])
    if not (pace and pace <= MAX_SLOW * interval and burst * pace < LIMIT) then
      return "corrupt pace " .. stored[12]
    end
  end
  -- (due may lie as far ahead of at as the burst at the slowest pace allowed: a due written while
  -- slowed outlives a later, faster pace, and a starter's doubt further, MAX_DOUBT; and as far
  -- behind as a refund moves it, a burst of intervals, protocol.settle; exact: at and both spans
  -- lie within 2^52 of 0)
  if not (at - burst * interval <= due and due <= at + (burst - 1) * slowest_pace() + MAX_DOUBT) then
    return "corrupt due " .. stored[5]
  end
  if not (0 <= max_running and max_running <= MAX_RUNNING) then
    return "corrupt max_running " .. stored[7]
  end
  if not (NEVER <= held and held < LIMIT) then
    return "corrupt held " .. stored[8]
  end
  if stored[11] then -- (a record written before the hold was added lacks it: NEVER)
    not_before = string.find(stored[11], "^%-?%d+$") and tonumber(stored[11])
    if not (not_before and NEVER <= not_before and not_before < LIMIT) then
      return "corrupt not_before " .. stored[11]
    end
  end
  if stored[13] then -- (likewise: NEVER)
    paced_at = string.find(stored[13], "^%-?%d+$") and tonumber(stored[13])
    if not (paced_at and NEVER <= paced_at and paced_at < LIMIT) then
      return "corrupt paced_at " .. stored[13]
    end
  end
  if stored[14] then -- (a record written before the settlement was added lacks it: 0)
    settled = string.find(stored[14], "^%d+$") and tonumber(stored[14])
    if not (settled and settled <= pos) then
      return "corrupt settled " .. stored[14]
    end
  end
  if stored[9] ~= "1" and stored[9] ~= "0" then
    return "corrupt paused " .. tostring(stored[9] or "(missing)")
  end
  paused = stored[9] == "1"
  -- paused_at means something only while paused (a record paused before it was added lacks it:
  -- NEVER); on a record not paused it is ignored, whatever it holds (an older version's resume
  -- leaves it behind), and the write below deletes it
  if paused and stored[15] then
    paused_at = string.find(stored[15], "^%-?%d+$") and tonumber(stored[15])
    if not (paused_at and NEVER <= paused_at and paused_at < LIMIT) then
      return "corrupt paused_at " .. stored[15]
    end
  end
  if not stored[10] then
    return "corrupt leases (missing)"
  end
  if stored[10] ~= "" then
    -- "TICKET:EXPIRY:TOKEN" joined by commas: each item up to a comma (one is added at the end);
    -- tickets of started jobs (at most pos), rising (leases are taken in start order)
    local last = 0
    for item in string.gmatch(stored[10] .. ",", "([^,]*),") do
      local t, expiry, token = string.match(item, "^(%d+):(%-?%d+):(%d+)$")
      t, expiry, token = tonumber(t), tonumber(expiry), tonumber(token)
      if not (t and expiry and token and last < t and t <= pos and NEVER <= expiry and expiry < LIMIT
              and token < LIMIT and #leases < max_running) then
        return "corrupt leases " .. stored[10]
      end
      leases[#leases + 1] = {t, expiry, token}
      last = t
    end
  end
  if stored[16] then -- a fair queue's record (one that is not fair lacks it)
    if stored[16] ~= "1" then
      return "corrupt fair " .. stored[16]
    end
    fair = true
    local more = redis.call("HMGET", KEYS[1], FIELDS[17], FIELDS[18], FIELDS[19])
    stored[17], stored[18], stored[19] = more[1], more[2], more[3]
    if stored[17] then
      number = string.find(stored[17], "^%d+$") and tonumber(stored[17])
      if not (number and 1 <= number and number < LIMIT) then
        return "corrupt number " .. stored[17]
      end
    end
    if stored[18] then
      begun = string.find(stored[18], "^%d+$") and tonumber(stored[18])
      if not (begun and begun < number) then
        return "corrupt begun " .. stored[18]
      end
    end
    if stored[19] then
      -- [number, tenant, weight, cost, ticket] each, numbers rising below number, tickets 0 or
      -- above pos and below ticket
      local function whole(value, low, high) -- a whole number from low to below high
        return type(value) == "number" and value == math.floor(value) and low <= value and value < high
      end
      local function size(t) -- the number of keys of table t (an array of n items has n)
        local n = 0
        for _ in pairs(t) do
          n = n + 1
        end
        return n
      end
      local ok, decoded = pcall(cjson.decode, stored[19])
      local good = ok and type(decoded) == "table" and string.sub(stored[19], 1, 1) == "["
        and size(decoded) == #decoded
      if good then
        local after = 0
        for i = 1, #decoded do
          local w = decoded[i]
          if not (type(w) == "table" and size(w) == 5 and whole(w[1], after + 1, number)
                  and type(w[2]) == "string" and whole(w[3], 1, MAX_WEIGHT + 1)
                  and whole(w[4], 1, LIMIT) and whole(w[5], 0, ticket)
                  and (w[5] == 0 or w[5] > pos)) then
            good = false
            break
          end
          waiters[i] = {w[1], w[2], w[3], w[4], w[5]}
          after = w[1]
        end
      end
      if not good then
        return "corrupt waiters " .. stored[19]
      end
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
    if fair ~= (ARGV[14] == "1") then
      return "mismatch fair " .. (fair and "1" or "0")
    end
  end
  if at > now + MAX_LEAD then
    return "unwritten at " .. stored[3] .. " " .. decimal(now)
  end
  if held > now + MAX_LEAD then
    return "unwritten held " .. stored[8] .. " " .. decimal(now)
  end
  if not_before > now + MAX_LEAD + MAX_HOLD then
    return "unwritten not_before " .. stored[11] .. " " .. decimal(now)
  end
  if paced_at > now + MAX_LEAD then
    return "unwritten paced_at " .. stored[13] .. " " .. decimal(now)
  end
  if paused_at > now + MAX_LEAD then
    return "unwritten paused_at " .. stored[15] .. " " .. decimal(now)
  end
  for _, lease in ipairs(leases) do
    if lease[2] > now + MAX_LEAD + MAX_LEASE then
      return "unwritten leases " .. decimal(lease[2]) .. " " .. decimal(now)
    end
  end
  if op == "read" then
    local words = {"record", decimal(now), stored[1], stored[2], stored[3], stored[4],
      decimal(burst), decimal(due), paused and "1" or "0", decimal(max_running), decimal(held),
      decimal(not_before), decimal(pace), decimal(paced_at), decimal(settled), decimal(paused_at)}
    for _, lease in ipairs(leases) do
      words[#words + 1] = decimal(lease[1])
      words[#words + 1] = decimal(lease[2])
      words[#words + 1] = decimal(lease[3])
    end
    if fair then
      return table.concat(words, " ") .. "\n" .. decimal(number) .. " " .. decimal(begun) .. " "
        .. waiters_text()
    end
    return table.concat(words, " ")
  end
end

-- the lease a start or a renewal takes (us), used only with max_running
local lease_us = tonumber(ARGV[6])
-- the token naming the ticket's lease (0: none)
local token = tonumber(ARGV[12])
-- how much (us) a new start moves due past its slot or start, for its starter's doubt of the clock
local doubt = tonumber(ARGV[13])

-- the start of the live lease named by token, answered again (a call retried after its reply
-- was lost): its ticket and start, or nil
local function repeated()
  if token > 0 then
    for _, lease in ipairs(leases) do
      if lease[3] == token and lease[2] > now then
        return lease[1], lease[2] - lease_us
      end
    end
  end
  return nil
end

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

-- protocol.effective_interval: the interval the slots count at now, the queue's own or more after
-- a slow-down, whose excess over it halves every RECOVER since paced_at (whole halvings)
local function effective()
  if pace <= interval then
    return interval
  end
  local halvings = 0
  if now > paced_at then
    -- (floored exactly: where it is below 53, the quotient is too small to round up to a whole)
    halvings = math.floor((now - paced_at) / RECOVER)
  end
  if halvings >= 53 then
    return interval
  end
  -- (exact: dividing by a power of two below 2^53, the excess below 2^52)
  return interval + math.floor((pace - interval) / 2 ^ halvings)
end

-- protocol.Record.slot with slots `step` apart: the strict slot of ticket t (> pos), counted from
-- due or, if later, from a step before the hold's end (protocol._due)
local function slot(t, step)
  return math.max(due, not_before - step) + (t - pos) * step
end

-- protocol.take: hand out the next ticket, holding `cost` numbers; first jump pos to the last one
-- handed out if every ticket since pos is at least one step past its slot (which a hold moves),
-- the slots counting at the effective interval
local function take(cost)
  if ticket + cost >= LIMIT then
    return nil
  end
  local last = ticket - 1
  local step = effective()
  if last > pos and math.max(due, not_before - step) + (last - pos + 1) * step <= now
      and held + FULL_GRACE <= now then
    pos = last
  end
  ticket = ticket + cost
  return last + 1
end

-- protocol.try_start: start ticket t, of `cost`, if its earliest start is at most `lead` us away;
-- a new start sets due to its strict slot or, if later, its start, plus the doubt
local function try_start(t, lead, cost)
  if pos == t and t < ticket and now < at + interval then
    return "started", t, at -- the latest start asked for again (a lost reply): the same start
  end
  local own, start = repeated() -- a start asked for again with its lease's token: the same start
  if own == t then
    return "started", t, start
  end
  if pos >= t or t >= ticket then
    return "passed", t, pos
  end
  local step = effective() -- the interval, or more while a slow-down lasts
  local strict = slot(t, step)
  -- never before the latest start, nor before the hold's end
  local earliest = math.max(strict - (burst - cost) * interval, at, not_before)
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
    leases[#leases + 1] = {t, start + lease_us, token}
  end
  pos, at, due = t, start, math.max(strict, start) + doubt
  return "started", t, start
end

-- a fair queue's steps, made for a fair record only (a record that is not fair runs as before)
local seated, enqueue, try_turn
if fair then
  -- protocol._seated: drop the waiters whose tickets were passed (at or below pos), then give each
  -- waiter without a ticket, in order, the next one (taking its cost in numbers) while its tenant
  -- holds fewer than its weight; nil, or the reply refusing a ticket that would reach LIMIT
  function seated()
    local holding, kept = {}, {}
    for _, w in ipairs(waiters) do
      if w[5] == 0 or w[5] > pos then
        if w[5] ~= 0 then
          holding[w[2]] = (holding[w[2]] or 0) + 1
        end
        kept[#kept + 1] = w
      end
    end
    for _, w in ipairs(kept) do
      if w[5] == 0 and (holding[w[2]] or 0) < w[3] then
        if ticket + w[4] >= LIMIT then
          return "unwritten ticket " .. decimal(ticket) .. " " .. decimal(now)
        end
        w[5] = ticket
        holding[w[2]] = (holding[w[2]] or 0) + 1
        ticket = ticket + w[4]
      end
    end
    waiters = kept
    return nil
  end

  -- protocol.enqueue: G4's jump (take, without a ticket), then a new waiter of the op's tenant and
  -- weight, of `cost`, at the back, and the tickets its turn gives (seated); its number, or nil and
  -- the reply refusing it
  function enqueue(cost)
    take(0)
    if number + 1 >= LIMIT then
      return nil, "unwritten number " .. decimal(number) .. " " .. decimal(now)
    end
    local mine = number
    waiters[#waiters + 1] = {mine, ARGV[16], tonumber(ARGV[15]), cost, 0}
    number = number + 1
    local refused = seated()
    if refused then
      return nil, refused
    end
    return mine
  end

  -- protocol.try_turn: start waiter n's ticket, of `cost`, as try_start would; a waiter without a
  -- ticket waits for its tenant's first; a number not in the line is passed. Answers as try_start
  -- (the kind nil, and the reply refusing it, when a ticket handed out would reach LIMIT)
  function try_turn(n, lead, cost)
    if n == begun and pos < ticket and now < at + interval then
      return "started", pos, at -- the latest start asked for again (a lost reply): the same start
    end
    local own, start = repeated() -- a start asked for again with its lease's token: the same start
    if own then
      return "started", own, start
    end
    local index
    for i, w in ipairs(waiters) do
      if w[1] == n then
        index = i
        break
      end
    end
    if not index then
      return "passed", n, pos
    end
    local mine = waiters[index]
    local step = effective()
    if mine[5] == 0 then
      -- no sooner than its tenant's first ticket may start (protocol.Record.earliest), nor than a
      -- step from now
      local first = 0
      for _, w in ipairs(waiters) do
        if w[2] == mine[2] and w[5] ~= 0 and (first == 0 or w[5] < first) then
          first = w[5]
        end
      end
      local after = now + step
      if first > pos then
        local slowest = math.max(interval, pace)
        after = math.max(slot(first, slowest) - (burst - cost) * interval, at, not_before)
      end
      if burst == 1 then
        -- an interval more for each waiter of its tenant without a ticket before it
        for _, w in ipairs(waiters) do
          if w[2] == mine[2] and w[5] == 0 and w[1] < mine[1] then
            after = after + interval
          end
        end
      end
      return "wait", n, math.max(after, now + step)
    end
    local kind, t, value = try_start(mine[5], lead, cost)
    if kind == "wait" then
      return kind, n, value
    end
    if kind == "started" then -- it leaves the line
      table.remove(waiters, index)
      begun = n
    else
      t = n
    end
    local refused = seated()
    if refused then
      return nil, refused
    end
    return kind, t, value
  end

end

-- protocol.retime: move the latest start to now + lead at the earliest, and due by as much (to the
-- start plus the doubt at least: what the start added to due, a doubt or an overrun, stays)
local function retime(t, lead)
  if pos ~= t or t >= ticket then
    return "passed", t, pos
  end
  local start = math.max(at, now + lead)
  local moved = start - at
  for _, lease in ipairs(leases) do -- the ticket's lease moves on by as much as its start
    if lease[1] == t then
      lease[2] = lease[2] + moved
    end
  end
  at = start
  due = math.max(due + moved, at + doubt)
  return "started", t, at
end

-- protocol.release: drop ticket t's lease named by token, and the expired ones; whether it was live
local function release(t)
  local live = live_leases()
  local kept = {}
  for _, lease in ipairs(live) do
    if lease[1] ~= t or lease[3] ~= token then
      kept[#kept + 1] = lease
    end
  end
  leases = kept
  return #kept < #live
end

-- protocol.renew: make ticket t's lease named by token last until now + lease_us at least,
-- dropping the expired ones; whether it was live
local function renew(t)
  leases = live_leases()
  local found = false
  for _, lease in ipairs(leases) do
    if lease[1] == t and lease[3] == token then
      lease[2] = math.max(lease[2], now + lease_us)
      found = true
    end
  end
  return found
end

-- tell the shards of other processes waiting for a place that one may be free (freed.py)
local function tell_freed()
  redis.call("PUBLISH", KEYS[1] .. "#freed", "")
end

local reply
if op == "set_paused" then
  -- protocol.set_paused: only the flag changes, and paused_at: now when a pause begins (one asked
  -- again keeps the first's), NEVER on resume
  local wanted = ARGV[11] == "1"
  reply = {"set", wanted ~= paused and "1" or "0", decimal(now)}
  if wanted ~= paused then
    paused = wanted
    paused_at = wanted and now or NEVER
  end
elseif op == "hold" then
  -- protocol.hold: no start before now + lead; a hold only grows (one ending later is kept)
  local ends = now + tonumber(ARGV[9])
  reply = {"set", ends > not_before and "1" or "0", decimal(now)}
  not_before = math.max(not_before, ends)
elseif op == "lift" then
  -- protocol.lift: no hold; whether one was on at now
  reply = {"set", not_before ~= NEVER and not_before > now and "1" or "0", decimal(now)}
  not_before = NEVER
elseif op == "slow" then
  -- protocol.slow: slots at the interval asked for at least (0: twice the effective one) from now,
  -- at most MAX_SLOW intervals and so that burst of them stay below LIMIT; whether it slowed
  local current = effective()
  local wanted = tonumber(ARGV[9])
  if wanted <= 0 then
    wanted = 2 * current
  end
  local slower = math.min(wanted, slowest_pace())
  reply = {"set", slower > current and "1" or "0", decimal(now)}
  if slower > current then
    pace, paced_at = slower, now
  end
elseif op == "settle" then
  -- protocol.settle: ticket t's job, started for `estimate`, cost `actual`; whether due moved
  local t, actual, estimate = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
  local moved = false
  if 0 < t and t <= pos and at ~= NEVER and t ~= settled and actual ~= estimate then
    -- (every span below is whole and stays below 2^53, so exact; see each)
    if actual > estimate then
      -- an overrun: due moves by the excess at the effective interval, to at + (burst - 1)
      -- slowest paces at most, and never back: a due a doubt put past that cap stays (room: at
      -- most that span plus a burst of intervals, below 2^53, and at least -MAX_DOUBT; the
      -- excess, less than burst steps of at most the slowest pace, below 2^52)
      local room = at + (burst - 1) * slowest_pace() - due
      if room > 0 then
        due = due + math.min((actual - estimate) * effective(), room)
        moved = true
      end
    else
      -- a refund: due moves back by the saving at the interval (below burst intervals, 2^52), to
      -- at + (pos - t - estimate) intervals at least. That span is at least -burst intervals; past
      -- 2^52 (however rounded: rounding keeps it there) the floor lies beyond due, which lies
      -- less than 2^52 past at (burst - 1 slowest paces, each at most (LIMIT - 1) / burst, and
      -- MAX_DOUBT, less than that quotient, at least 2^21 - 1), so nothing moves; below, it is
      -- exact, and so is due less the floor
      local span = (pos - t - estimate) * interval
      if span < LIMIT then
        local room = (due - at) - span
        if room > 0 then
          due = due - math.min((estimate - actual) * interval, room)
          moved = true
        end
      end
    end
  end
  reply = {"set", moved and "1" or "0", decimal(now)}
  if moved then
    settled = t
  end
elseif op == "release" or op == "renew" then
  local live
  if op == "release" then
    live = release(tonumber(ARGV[8]))
    if live and held + FULL_GRACE > now then -- a place freed while a ticket may wait for one
      tell_freed()
    end
  else
    live = renew(tonumber(ARGV[8]))
  end
  reply = {"live", live and "1" or "0", decimal(now)}
elseif op == "take" then
  local t, refused
  if fair then
    t, refused = enqueue(tonumber(ARGV[10]))
    if not t then
      return refused
    end
  else
    t = take(tonumber(ARGV[10]))
    if not t then
      return "unwritten ticket " .. decimal(ticket) .. " " .. decimal(now)
    end
  end
  reply = {"taken", decimal(t), decimal(pos), decimal(at), decimal(now)}
else
  local kind, t, value
  if op == "try_start" then
    kind, t, value = (fair and try_turn or try_start)(tonumber(ARGV[8]), tonumber(ARGV[9]),
      tonumber(ARGV[10]))
    if not kind then
      return t
    end
  elseif op == "take_and_try" or op == "try_take" then -- (try_take: written only if started, below)
    local cost = tonumber(ARGV[10])
    kind, t, value = "started", repeated() -- the call retried after its reply was lost: its start
    if not t then
      if fair then -- protocol.enqueue_and_try
        t, value = enqueue(cost)
        if not t then
          return value
        end
        kind, t, value = try_turn(t, tonumber(ARGV[9]), cost)
        if not kind then
          return t
        end
      else
        t = take(cost)
        if not t then
          return "unwritten ticket " .. decimal(ticket) .. " " .. decimal(now)
        end
        kind, t, value = try_start(t, tonumber(ARGV[9]), cost)
      end
    end
  elseif op == "retime" then
    kind, t, value = retime(tonumber(ARGV[8]), tonumber(ARGV[9]))
  else
    return redis.error_reply("ratequeue: unknown operation " .. tostring(op))
  end
  if kind == "started" and op ~= "retime" and max_running > 0 and #leases < max_running
      and held + FULL_GRACE > now then
    tell_freed() -- a place is left, and the next ticket, which the grace held back, may take it
  end
  reply = {kind, decimal(t), decimal(value), decimal(now)}
  if op == "try_take" and kind ~= "started" then
    -- protocol.try_take: no start, nothing written (no ticket, waiter, jump, held, keep time)
    return table.concat(reply, " ")
  end
end

-- the latest of protocol.expires: the slot of the next ticket (moved by a hold) plus a step, the
-- slots counting at the slowest pace held (the interval, or pace if slower), the end of the grace
-- after the queue was last found full, and every lease's expiry
local slowest = math.max(interval, pace)
local expires = math.max(slot(ticket, slowest) + slowest, held + FULL_GRACE)
local pairs_text = {}
for i, lease in ipairs(leases) do
  pairs_text[i] = decimal(lease[1]) .. ":" .. decimal(lease[2]) .. ":" .. decimal(lease[3])
  expires = math.max(expires, lease[2])
end
-- not_before, pace, paced_at, settled and paused_at only while not their default: a record without
-- a hold, a slow-down, a settlement or a pause is stored as before they were added
local extra_fields, defaults = {}, {}
local function store_field(i, value, default)
  if value ~= default then
    extra_fields[#extra_fields + 1] = FIELDS[i]
    extra_fields[#extra_fields + 1] = decimal(value)
  elseif stored[i] then
    defaults[#defaults + 1] = FIELDS[i]
  end
end
store_field(11, not_before, NEVER)
store_field(12, pace, 0)
store_field(13, paced_at, NEVER)
store_field(14, settled, 0)
store_field(15, paused_at, NEVER)
if fair then -- (a record that is not fair stores none of them)
  extra_fields[#extra_fields + 1] = "fair"
  extra_fields[#extra_fields + 1] = "1"
  extra_fields[#extra_fields + 1] = "number"
  extra_fields[#extra_fields + 1] = decimal(number)
  extra_fields[#extra_fields + 1] = "begun"
  extra_fields[#extra_fields + 1] = decimal(begun)
  extra_fields[#extra_fields + 1] = "waiters"
  extra_fields[#extra_fields + 1] = waiters_text()
end
if #defaults > 0 then
  redis.call("HDEL", KEYS[1], unpack(defaults))
end
redis.call("HSET", KEYS[1], "ticket", decimal(ticket), "pos", decimal(pos), "at", decimal(at),
  "interval", decimal(interval), "due", decimal(due), "burst", decimal(burst),
  "max_running", decimal(max_running), "held", decimal(held), "paused", paused and "1" or "0",
  "leases", table.concat(pairs_text, ","), unpack(extra_fields))

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
