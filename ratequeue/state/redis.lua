--[[
ratequeue's operations on one queue's record, each run atomically on the Redis server's clock.

The steps translate ratequeue/protocol.py, the reference every backend is held to (DESIGN.md §3).
The Python side, ratequeue/state/_redis_codec.py, packs the arguments and parses the reply.

One script serves every operation, chosen by ARGV[1], rather than one script per operation:
the record's reading and checks are written once (no script is assembled from shared pieces),
and there is one SHA to send and one SCRIPT LOAD after a NOSCRIPT (a restart, SCRIPT FLUSH).

KEYS[1]   the queue's hash: fields ticket, pos, at, interval, each a whole number in decimal
ARGV[1]   the operation: take, try_start, take_and_try, retime or read
ARGV[2]   the interval (us) the caller expects; a record created now gets it (read: ignored)
ARGV[3]   "" to read the server's TIME, or a fixed now (us) set by a test
ARGV[4..] the operation's own arguments, as its Python method takes them:
            try_start, retime: ticket, lead (us)
            take_and_try:      lead (us)

The reply is one string of words separated by single spaces (the client parses one bulk string
in a fraction of the CPU an array of four or five items costs it); numbers are whole, in decimal:
  take                               "taken TICKET POS AT NOW"
  try_start, take_and_try, retime    "started TICKET START NOW", "wait TICKET SLOT NOW"
                                     or "passed TICKET POS NOW"
  read                               "record NOW TICKET POS AT INTERVAL", or "none NOW"
and, changing nothing:
  any operation but read, when the stored interval is not ARGV[2]:   "mismatch INTERVAL"
  any operation, when the stored record is malformed:                "corrupt FIELD VALUE"
  any operation, when `at` lies more than MAX_LEAD past now (no start the protocol grants
  does; see protocol.check):                                         "unwritten at AT NOW"
  take and take_and_try, when ticket is the last one (LIMIT - 1):    "unwritten ticket TICKET NOW"

take, try_start, take_and_try and retime create a missing record (ticket 1, pos 0, at NEVER)
and write the record back; read never writes.
]]

-- ratequeue.protocol.NEVER, -2^52: the `at` of a record that has never started a job
local NEVER = -4503599627370496
-- ratequeue.state.base.MAX_US, 2^52: times and intervals stay below it, so every slot is exact
-- in a double
local LIMIT = 4503599627370496
-- ratequeue.protocol.MAX_LEAD_US, an hour: no start lies further ahead of the clock it was granted on
local MAX_LEAD = 3600000000

local op = ARGV[1]

local now
if ARGV[3] == "" then
  local time = redis.call("TIME")
  now = tonumber(time[1]) * 1000000 + tonumber(time[2])
else
  now = tonumber(ARGV[3])
end

-- a whole number as the decimal text it is stored and answered as
local function decimal(value)
  return string.format("%.0f", value)
end

local FIELDS = {"ticket", "pos", "at", "interval"}
local stored = redis.call("HMGET", KEYS[1], "ticket", "pos", "at", "interval")
local ticket, pos, at, interval
if not (stored[1] or stored[2] or stored[3] or stored[4]) then
  if op == "read" then
    return "none " .. decimal(now)
  end
  ticket, pos, at, interval = 1, 0, NEVER, tonumber(ARGV[2])
else
  local values = {}
  for i = 1, 4 do
    local text = stored[i]
    if not text then
      return "corrupt " .. FIELDS[i] .. " (missing)"
    end
    if not string.find(text, "^%-?%d+$") then
      return "corrupt " .. FIELDS[i] .. " " .. text
    end
    values[i] = tonumber(text)
  end
  ticket, pos, at, interval = values[1], values[2], values[3], values[4]
  if not (0 <= pos and pos < ticket and ticket < LIMIT and 0 < interval and interval < LIMIT
          and NEVER <= at and at < LIMIT) then
    return "corrupt ticket/pos/at/interval " .. table.concat(stored, "/")
  end
  if op ~= "read" and interval ~= tonumber(ARGV[2]) then
    return "mismatch " .. stored[4]
  end
  if at > now + MAX_LEAD then
    return "unwritten at " .. stored[3] .. " " .. decimal(now)
  end
  if op == "read" then
    return table.concat({"record", decimal(now), stored[1], stored[2], stored[3], stored[4]}, " ")
  end
  if (op == "take" or op == "take_and_try") and ticket + 1 >= LIMIT then
    return "unwritten ticket " .. stored[1] .. " " .. decimal(now)
  end
end

-- protocol.take: hand out the next ticket; first jump pos to the last one handed out if every
-- ticket since pos is at least one interval past its slot
local function take()
  local last = ticket - 1
  if last > pos and at + (last - pos) * interval + interval <= now then
    pos = last
  end
  ticket = ticket + 1
  return last + 1
end

-- protocol.try_start: start ticket t if its slot is at most `lead` us away
local function try_start(t, lead)
  if pos == t and t < ticket and now < at + interval then
    return "started", t, at -- the latest start asked for again (a lost reply): the same grant
  end
  if pos >= t or t >= ticket then
    return "passed", t, pos
  end
  local slot = at + (t - pos) * interval
  if now + lead >= slot then
    pos, at = t, math.max(slot, now)
    return "started", t, at
  end
  return "wait", t, slot
end

-- protocol.retime: move the latest start to now + lead at the earliest
local function retime(t, lead)
  if pos ~= t or t >= ticket then
    return "passed", t, pos
  end
  at = math.max(at, now + lead)
  return "started", t, at
end

local reply
if op == "take" then
  local t = take()
  reply = {"taken", decimal(t), decimal(pos), decimal(at), decimal(now)}
else
  local kind, t, value
  if op == "try_start" then
    kind, t, value = try_start(tonumber(ARGV[4]), tonumber(ARGV[5]))
  elseif op == "take_and_try" then
    kind, t, value = try_start(take(), tonumber(ARGV[4]))
  elseif op == "retime" then
    kind, t, value = retime(tonumber(ARGV[4]), tonumber(ARGV[5]))
  else
    return redis.error_reply("ratequeue: unknown operation " .. tostring(op))
  end
  reply = {kind, decimal(t), decimal(value), decimal(now)}
end

redis.call("HSET", KEYS[1], "ticket", decimal(ticket), "pos", decimal(pos), "at", decimal(at),
  "interval", decimal(interval))
return table.concat(reply, " ")
