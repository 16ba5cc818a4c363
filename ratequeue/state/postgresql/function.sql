-- ratequeue's PostgreSQL backend: the table of records and the one function every operation calls.
--
-- @TABLE@ and @FUNCTION@ are replaced by the (quoted, checked) names of the table and of its
-- function before this is run; statements are separated by lines holding only "-- ;;".
-- The function's name carries a version (_v4): a release that changes what it does or its
-- signature gives it a new name, so that older and newer clients never replace each other's
-- (_v1 had no hold, no slow-down and no settlement: it leaves not_before_us, pace_us, paced_at_us
-- and settled as it finds them, and ignores them; _v2 had no p_doubt, and refuses a due_us that a
-- doubt moved past at + (burst - 1) slowest paces; _v3 had no fair queues, no p_fair, p_tenant and
-- p_weight: it leaves fair, number, begun, waiters and tenants as it finds them, and runs a fair row
-- as if it were not fair; _v1 to _v3 did not note when a pause began: they leave paused_at_us as
-- they find it, also on a resume, which this version then ignores). A table is shared by every version: setting up this one leaves an older one's
-- function in place.
--
-- One row per queue name; every time and interval is whole microseconds (bigint), as in
-- ratequeue.core.protocol. leases holds the (ticket, expiry, token) of running jobs flattened, in start
-- order: {ticket1, expiry1, token1, ticket2, expiry2, token2, ...}. not_before_us is the end of a hold
-- (protocol.hold; NULL: none, as NEVER). pace_us is the interval the last slow-down set (protocol.slow;
-- 0: none) and paced_at_us when it was made (NULL: never, as NEVER). settled is the ticket of the
-- latest settlement that moved due_us (protocol.settle; 0: none). keep_until_us is the state-clock
-- time from which the row may be deleted (NULL: kept forever). A fair queue's row (fair true,
-- protocol.enqueue) holds its next waiter number, the number of the waiter that started last (begun),
-- and its waiters in the order they came: waiters holds their (number, weight, cost, ticket) flattened
-- as leases are, {number1, weight1, cost1, ticket1, number2, ...}, and tenants their tenants, one
-- each. A row that is not fair holds NULL in all five (fair false would say the same), as a row
-- made before fair queues does: it is stored exactly as before, and nothing reads them.
-- paused_at_us is when the pause everywhere began (protocol.set_paused), held only while paused:
-- NULL (NEVER) in a row that is not paused, so that such a row is stored exactly as before, and in
-- a row paused by an older version, which did not note it ("since when" unknown). It is read only
-- while the row is paused: an older version's resume leaves it behind in a row not paused, where it
-- is ignored, whatever it holds, and this version's next write of the row clears it.
CREATE TABLE IF NOT EXISTS @TABLE@ (
    name text PRIMARY KEY,
    ticket bigint NOT NULL,
    pos bigint NOT NULL,
    at_us bigint NOT NULL,
    interval_us bigint NOT NULL,
    burst bigint NOT NULL DEFAULT 1,
    due_us bigint NOT NULL,
    paused boolean NOT NULL DEFAULT false,
    max_running integer NOT NULL DEFAULT 0,
    leases bigint[] NOT NULL DEFAULT '{}',
    held_us bigint NOT NULL DEFAULT -4503599627370496,
    keep_until_us bigint,
    not_before_us bigint,
    pace_us bigint NOT NULL DEFAULT 0,
    paced_at_us bigint,
    settled bigint NOT NULL DEFAULT 0,
    fair boolean,
    number bigint,
    begun bigint,
    waiters bigint[],
    tenants text[],
    paused_at_us bigint
)
-- ;;
-- a table made before the hold (by _v1), before the slow-down, before the settlement, before fair
-- queues (by _v3) or before paused_at_us gains the columns it lacks; its rows read NULL (no hold,
-- never slowed, not fair, no pause noted) and 0 (no pace, never settled) there. Only then is the
-- table altered (which takes its lock, and needs its owner's rights)
DO $ratequeue$
BEGIN
    IF (SELECT count(*) FROM pg_attribute WHERE attrelid = '@TABLE@'::regclass
        AND attname IN ('not_before_us', 'pace_us', 'paced_at_us', 'settled', 'fair', 'number', 'begun',
                        'waiters', 'tenants', 'paused_at_us') AND NOT attisdropped) < 10 THEN
        ALTER TABLE @TABLE@ ADD COLUMN IF NOT EXISTS not_before_us bigint,
                            ADD COLUMN IF NOT EXISTS pace_us bigint NOT NULL DEFAULT 0,
                            ADD COLUMN IF NOT EXISTS paced_at_us bigint,
                            ADD COLUMN IF NOT EXISTS settled bigint NOT NULL DEFAULT 0,
                            ADD COLUMN IF NOT EXISTS fair boolean,
                            ADD COLUMN IF NOT EXISTS number bigint,
                            ADD COLUMN IF NOT EXISTS begun bigint,
                            ADD COLUMN IF NOT EXISTS waiters bigint[],
                            ADD COLUMN IF NOT EXISTS tenants text[],
                            ADD COLUMN IF NOT EXISTS paused_at_us bigint;
    END IF;
END
$ratequeue$
-- ;;
-- @FUNCTION@(op, name, ...): one operation of ratequeue.core.protocol on queue `name`, atomically, on the
-- server's clock; called autocommit, each call is its own transaction.
--
--   p_op           take, try_start, take_and_try, try_take, retime, set_paused, release, renew, hold,
--                  lift, slow, settle (they lock the row, creating it if missing, and write it back;
--                  try_take only if it starts), read (changes nothing, creates nothing) or sweep (deletes
--                  the rows whose keep time has passed; p_name ignored)
--   p_interval, p_burst, p_max_running, p_fair
--                  the terms the caller expects: a missing row is created with them, a stored row
--                  with others is answered "mismatch", changing nothing
--   p_keep         keep the row until p_keep us after the later of now and protocol.expires of
--                  the record written; 0 (or a paused record): forever
--   p_lease        the lease (us) a start or a renewal takes, with max_running
--   p_now          NULL for the server's clock_timestamp(), or a fixed now (us) set by a test
--   p_ticket, p_lead, p_cost, p_paused, p_token, p_doubt
--                  the operation's own arguments (unused ones are ignored; the lead_us of hold and
--                  of slow, the interval to slow to at least, is p_lead; settle's estimate is p_cost
--                  and its actual cost, not a time, p_lead; p_doubt is the doubt_us of try_start,
--                  take_and_try and try_take, 0 to MAX_DOUBT_US)
--   p_tenant, p_weight
--                  take, take_and_try and try_take on a fair row: the new waiter's tenant and weight
--
-- On a fair row take, try_start and take_and_try are protocol.enqueue, try_turn and enqueue_and_try:
-- they name waiters by their numbers (a started one's answer names its ticket); every other
-- operation works on tickets, as on a row that is not fair.
--
-- try_take (protocol.try_take) is take_and_try (on a fair row enqueue_and_try) that writes nothing
-- unless it starts: its wait names the ticket (the waiter's number) not taken, and leaves the row
-- as it was (no ticket, no waiter, no jump, no full row noted, the keep time not moved).
--
-- The answer is one row (kind, a, b, c, now, created, stored), now in us on the clock used:
--   take                               ("taken", TICKET, POS, AT); on a fair row ("taken", NUMBER, POS, AT)
--   try_start, take_and_try, try_take, retime
--                                      ("started", TICKET, START), ("wait", TICKET, SLOT)
--                                      or ("passed", TICKET, POS); on a fair row, NUMBER for TICKET
--                                      but in "started"
--   set_paused                         ("set", 1 if the flag changed else 0); a pause begun notes
--                                      now in paused_at_us, a resume clears it
--   hold                               ("set", 1 if the hold moved else 0)
--   lift                               ("set", 1 if a hold was on at now else 0)
--   slow                               ("set", 1 if the queue was slowed else 0)
--   settle                             ("set", 1 if due moved else 0)
--   release, renew                     ("live", 1 if the ticket's lease was live else 0)
--   read                               ("record", stored = the row as jsonb) or ("none")
--   sweep                              ("swept", how many rows were deleted)
-- and, changing nothing (the client words the error):
--   a stored row the protocol could not have written          ("corrupt", stored = the row)
--   a stored row with another interval, burst, max_running or fairness
--                                                             ("mismatch", stored = the row)
--   `at`, `held`, `paced_at` or `paused_at` more than MAX_LEAD past now, `not_before` more than
--   MAX_LEAD + MAX_HOLD, a lease's expiry more than MAX_LEAD + MAX_LEASE (protocol.check)
--                                       ("unwritten_at", AT), ("unwritten_held", HELD),
--                                       ("unwritten_not_before", NOT_BEFORE),
--                                       ("unwritten_paced_at", PACED_AT),
--                                       ("unwritten_paused_at", PAUSED_AT), ("unwritten_leases", EXPIRY)
--   take, take_and_try and try_take, when ticket + cost reaches LIMIT
--                                                             ("unwritten_ticket", TICKET)
--   take, try_start, take_and_try and try_take on a fair row, when a waiter's ticket + its cost would
--   reach LIMIT                                               ("unwritten_ticket", TICKET)
--   a fair take, take_and_try or try_take, when number + 1 reaches LIMIT
--                                                             ("unwritten_number", NUMBER)
-- `created` is true when this call inserted the row. Slots are computed in numeric, so no record
-- can overflow them; every value stored stays below 2^54.
--
-- While a row was found full within FULL_GRACE (held_us + FULL_GRACE > now), a release that frees
-- a live lease, and a start that leaves a place free (the next ticket, held back by the grace, may
-- take it), also NOTIFY (pg_notify, delivered at commit) the channel 'ratequeue_freed_' followed by
-- the md5 of the table's quoted name, '/' and the queue's name (UTF-8), which the shards of other
-- processes waiting for a place LISTEN on (freed.py); nothing else notifies.
CREATE OR REPLACE FUNCTION @FUNCTION@(
    p_op text, p_name text, p_interval bigint, p_burst bigint, p_keep bigint, p_max_running integer,
    p_lease bigint, p_now bigint, p_ticket bigint, p_lead bigint, p_cost bigint, p_paused boolean,
    p_token bigint, p_doubt bigint, p_fair boolean, p_tenant text, p_weight bigint
) RETURNS TABLE (
    o_kind text, o_a numeric, o_b numeric, o_c numeric, o_now bigint, o_created boolean, o_stored jsonb
)
LANGUAGE plpgsql VOLATILE
AS $ratequeue$
DECLARE
    -- ratequeue.core.protocol.NEVER, MAX_US, MAX_LEAD_US, MAX_BURST, PAUSED_RECHECK_US,
    -- FULL_RECHECK_US, FULL_GRACE_US, MAX_RUNNING, MAX_LEASE_US, MAX_HOLD_US, MAX_SLOW, RECOVER_US and
    -- MAX_DOUBT_US
    c_never CONSTANT bigint := -4503599627370496;
    c_limit CONSTANT bigint := 4503599627370496;
    c_max_lead CONSTANT bigint := 3600000000;
    c_max_burst CONSTANT bigint := 2147483648;
    c_paused_recheck CONSTANT bigint := 1000000;
    c_full_recheck CONSTANT bigint := 100000;
    c_full_grace CONSTANT bigint := 300000;
    c_max_running CONSTANT integer := 1000;
    c_max_lease CONSTANT bigint := 86400000000;
    c_max_hold CONSTANT bigint := 86400000000;
    c_max_slow CONSTANT bigint := 64;
    c_recover CONSTANT bigint := 5000000;
    c_max_doubt CONSTANT bigint := 100000;
    -- keep times past this (about 146,000 years) are as good as forever
    c_keep_cap CONSTANT numeric := 4611686018427387904;
    r @TABLE@%ROWTYPE;
    v_ts timestamptz;
    v_now bigint;
    v_created boolean := false;
    v_tries integer := 0;
    v_ticket bigint;
    v_pos bigint;
    v_at bigint;
    v_due bigint;
    v_held bigint;
    v_not_before bigint;
    v_pace bigint;
    v_paced_at bigint;
    v_settled bigint;
    v_moved numeric;
    v_halvings bigint;
    v_step bigint;
    v_slowest bigint;
    v_paused boolean;
    v_paused_at bigint;
    v_leases bigint[];
    v_live bigint[];
    v_kept bigint[];
    v_n integer;
    v_i integer;
    v_t bigint;
    v_lead bigint;
    v_cost bigint;
    v_from numeric;
    v_strict numeric;
    v_earliest numeric;
    v_recheck numeric;
    v_start bigint;
    v_found boolean;
    v_last bigint;
    v_own integer;
    v_expires numeric;
    v_keep_until bigint;
    v_deleted bigint;
    v_freed boolean := false;
    -- a fair row's: protocol.try_start to run on v_t (try_start, take_and_try, try_take), the fair steps
    -- taken, the waiter number asked for and its index, the number, begun, waiters and tenants to write,
    -- the waiters kept while seating them and the tenants holding tickets, with how many each
    v_try boolean := false;
    v_fair boolean := false;
    v_asked bigint;
    v_me integer;
    v_number bigint;
    v_begun bigint;
    v_waiters bigint[];
    v_tenants text[];
    v_kw bigint[];
    v_kt text[];
    v_ht text[];
    v_hc bigint[];
    v_j integer;
BEGIN
    IF p_op = 'read' OR p_op = 'sweep' THEN
        v_ts := clock_timestamp();
        -- whole microseconds since the epoch, exact (extract returns a double before PostgreSQL 14)
        v_now := coalesce(p_now, extract(epoch FROM date_trunc('second', v_ts))::bigint * 1000000
                                 + extract(microseconds FROM v_ts)::bigint % 1000000);
        IF p_op = 'sweep' THEN
            DELETE FROM @TABLE@ WHERE keep_until_us <= v_now;
            GET DIAGNOSTICS v_deleted = ROW_COUNT;
            o_kind := 'swept'; o_a := v_deleted; o_now := v_now;
            RETURN NEXT;
            RETURN;
        END IF;
        SELECT * INTO r FROM @TABLE@ WHERE name = p_name;
        o_now := v_now;
        IF FOUND THEN
            o_kind := 'record'; o_stored := to_jsonb(r);
        ELSE
            o_kind := 'none';
        END IF;
        RETURN NEXT;
        RETURN;
    END IF;

    -- lock the row, creating it first if it is missing (a reset may delete it in between: again)
    LOOP
        SELECT * INTO r FROM @TABLE@ WHERE name = p_name FOR UPDATE;
        EXIT WHEN FOUND;
        v_tries := v_tries + 1;
        IF v_tries > 3 THEN
            RAISE EXCEPTION 'ratequeue: queue % disappeared while being created', p_name;
        END IF;
        IF p_fair THEN
            INSERT INTO @TABLE@ (name, ticket, pos, at_us, interval_us, burst, due_us, paused, max_running,
                                 leases, held_us, keep_until_us, fair, number, begun, waiters, tenants)
            VALUES (p_name, 1, 0, c_never, p_interval, p_burst, c_never, false, p_max_running, '{}',
                    c_never, NULL, true, 1, 0, '{}', '{}')
            ON CONFLICT (name) DO NOTHING;
        ELSE
            INSERT INTO @TABLE@ (name, ticket, pos, at_us, interval_us, burst, due_us, paused, max_running,
                                 leases, held_us, keep_until_us)
            VALUES (p_name, 1, 0, c_never, p_interval, p_burst, c_never, false, p_max_running, '{}',
                    c_never, NULL)
            ON CONFLICT (name) DO NOTHING;
        END IF;
        v_created := v_created OR FOUND;
    END LOOP;
    -- the clock is read once the row is locked: calls on one queue read it in the order they apply
    v_ts := clock_timestamp();
    v_now := coalesce(p_now, extract(epoch FROM date_trunc('second', v_ts))::bigint * 1000000
                             + extract(microseconds FROM v_ts)::bigint % 1000000);
    o_now := v_now;
    o_created := v_created;

    -- state.base.check_record: a row the protocol could not have written is refused
    v_n := coalesce(cardinality(r.leases), 0);
    IF NOT (0 <= r.pos AND r.pos < r.ticket AND r.ticket < c_limit
            AND c_never <= r.at_us AND r.at_us < c_limit
            AND 0 < r.interval_us AND r.interval_us < c_limit
            AND 1 <= r.burst AND r.burst <= c_max_burst
            AND r.burst::numeric * r.interval_us < c_limit
            AND 0 <= coalesce(r.pace_us, 0)
            AND coalesce(r.pace_us, 0)::numeric <= c_max_slow::numeric * r.interval_us
            AND r.burst::numeric * coalesce(r.pace_us, 0) < c_limit
            -- (a refund moves due behind at, by a burst of intervals at most: protocol.settle)
            AND r.at_us::numeric - r.burst::numeric * r.interval_us <= r.due_us
            -- (at the slowest pace a slow-down may set: a due written then outlives a faster pace;
            -- and as far ahead as a starter's doubt moves it: protocol.try_start)
            AND r.due_us::numeric <= r.at_us::numeric + (r.burst - 1)::numeric
                                     * least(c_max_slow::numeric * r.interval_us, (c_limit - 1) / r.burst)
                                     + c_max_doubt
            AND 0 <= r.max_running AND r.max_running <= c_max_running
            AND c_never <= r.held_us AND r.held_us < c_limit
            AND c_never <= coalesce(r.not_before_us, c_never) AND coalesce(r.not_before_us, c_never) < c_limit
            AND c_never <= coalesce(r.paced_at_us, c_never) AND coalesce(r.paced_at_us, c_never) < c_limit
            -- (a pause's start means something only while paused: a row not paused keeps it unread,
            -- whatever it holds, as an older version's resume leaves it behind)
            AND (NOT r.paused OR (c_never <= coalesce(r.paused_at_us, c_never)
                                  AND coalesce(r.paused_at_us, c_never) < c_limit))
            AND 0 <= coalesce(r.settled, 0) AND coalesce(r.settled, 0) <= r.pos
            AND (v_n = 0 OR (array_ndims(r.leases) = 1 AND array_lower(r.leases, 1) = 1))
            AND v_n % 3 = 0 AND v_n / 3 <= r.max_running) THEN
        o_kind := 'corrupt'; o_stored := to_jsonb(r);
        RETURN NEXT;
        RETURN;
    END IF;
    -- each lease: a started ticket (at most pos, rising: leases are taken in start order), an
    -- expiry and a token
    v_last := 0;
    FOR v_i IN 1 .. v_n / 3 LOOP
        IF r.leases[3 * v_i - 2] IS NULL OR r.leases[3 * v_i - 1] IS NULL OR r.leases[3 * v_i] IS NULL
           OR NOT (v_last < r.leases[3 * v_i - 2] AND r.leases[3 * v_i - 2] <= r.pos
                   AND c_never <= r.leases[3 * v_i - 1] AND r.leases[3 * v_i - 1] < c_limit
                   AND 0 <= r.leases[3 * v_i] AND r.leases[3 * v_i] < c_limit) THEN
            o_kind := 'corrupt'; o_stored := to_jsonb(r);
            RETURN NEXT;
            RETURN;
        END IF;
        v_last := r.leases[3 * v_i - 2];
    END LOOP;
    -- a fair row's number, begun and waiters (records.check_record; a row that is not fair keeps
    -- them unread): numbers rising below number, a tenant each, weights 1 to MAX_WEIGHT (1000), costs
    -- from 1, tickets 0 (none yet) or above pos and below ticket
    IF r.fair THEN
        v_n := coalesce(cardinality(r.tenants), 0);
        IF r.number IS NULL OR r.begun IS NULL OR r.waiters IS NULL OR r.tenants IS NULL
           OR NOT (1 <= r.number AND r.number < c_limit AND 0 <= r.begun AND r.begun < r.number
                AND coalesce(cardinality(r.waiters), 0) = 4 * v_n
                AND (v_n = 0 OR (array_ndims(r.waiters) = 1 AND array_lower(r.waiters, 1) = 1
                                 AND array_ndims(r.tenants) = 1 AND array_lower(r.tenants, 1) = 1))) THEN
            o_kind := 'corrupt'; o_stored := to_jsonb(r);
            RETURN NEXT;
            RETURN;
        END IF;
        v_last := 0;
        FOR v_i IN 1 .. v_n LOOP
            IF r.tenants[v_i] IS NULL OR r.waiters[4 * v_i - 3] IS NULL OR r.waiters[4 * v_i - 2] IS NULL
               OR r.waiters[4 * v_i - 1] IS NULL OR r.waiters[4 * v_i] IS NULL
               OR NOT (v_last < r.waiters[4 * v_i - 3] AND r.waiters[4 * v_i - 3] < r.number
                       AND 1 <= r.waiters[4 * v_i - 2] AND r.waiters[4 * v_i - 2] <= 1000
                       AND 1 <= r.waiters[4 * v_i - 1]
                       AND (r.waiters[4 * v_i] = 0
                            OR (r.pos < r.waiters[4 * v_i] AND r.waiters[4 * v_i] < r.ticket))) THEN
                o_kind := 'corrupt'; o_stored := to_jsonb(r);
                RETURN NEXT;
                RETURN;
            END IF;
            v_last := r.waiters[4 * v_i - 3];
        END LOOP;
        v_n := coalesce(cardinality(r.leases), 0);
    END IF;
    IF r.interval_us <> p_interval OR r.burst <> p_burst OR r.max_running <> p_max_running
       OR coalesce(r.fair, false) <> p_fair THEN
        o_kind := 'mismatch'; o_stored := to_jsonb(r);
        RETURN NEXT;
        RETURN;
    END IF;
    -- protocol.check
    IF r.at_us > v_now + c_max_lead THEN
        o_kind := 'unwritten_at'; o_a := r.at_us;
        RETURN NEXT;
        RETURN;
    END IF;
    IF r.held_us > v_now + c_max_lead THEN
        o_kind := 'unwritten_held'; o_a := r.held_us;
        RETURN NEXT;
        RETURN;
    END IF;
    IF r.not_before_us > v_now + c_max_lead + c_max_hold THEN
        o_kind := 'unwritten_not_before'; o_a := r.not_before_us;
        RETURN NEXT;
        RETURN;
    END IF;
    IF r.paced_at_us > v_now + c_max_lead THEN
        o_kind := 'unwritten_paced_at'; o_a := r.paced_at_us;
        RETURN NEXT;
        RETURN;
    END IF;
    IF r.paused AND r.paused_at_us > v_now + c_max_lead THEN
        o_kind := 'unwritten_paused_at'; o_a := r.paused_at_us;
        RETURN NEXT;
        RETURN;
    END IF;
    FOR v_i IN 1 .. v_n / 3 LOOP
        IF r.leases[3 * v_i - 1] > v_now + c_max_lead + c_max_lease THEN
            o_kind := 'unwritten_leases'; o_a := r.leases[3 * v_i - 1];
            RETURN NEXT;
            RETURN;
        END IF;
    END LOOP;

    v_ticket := r.ticket; v_pos := r.pos; v_at := r.at_us; v_due := r.due_us; v_held := r.held_us;
    v_not_before := coalesce(r.not_before_us, c_never); v_paused := r.paused;
    -- (NEVER in a row not paused, whatever it holds: the row's next write clears it)
    v_paused_at := CASE WHEN r.paused THEN coalesce(r.paused_at_us, c_never) ELSE c_never END;
    v_pace := coalesce(r.pace_us, 0); v_paced_at := coalesce(r.paced_at_us, c_never);
    v_settled := coalesce(r.settled, 0);
    -- protocol.effective_interval: what the slots count at now, the interval or, after a slow-down,
    -- more: the pace's excess over the interval halves every RECOVER since paced_at (whole halvings)
    IF v_pace <= r.interval_us THEN
        v_step := r.interval_us;
    ELSE
        v_halvings := CASE WHEN v_now > v_paced_at THEN (v_now - v_paced_at) / c_recover ELSE 0 END;
        v_step := CASE WHEN v_halvings < 53
                       THEN r.interval_us + ((v_pace - r.interval_us) >> v_halvings::integer)
                       ELSE r.interval_us END;
    END IF;
    -- protocol._due: what the slots of the tickets after pos count from, due or, if later, a step
    -- before the hold's end
    v_from := greatest(v_due::numeric, v_not_before::numeric - v_step);
    v_leases := CASE WHEN v_n = 0 THEN '{}'::bigint[] ELSE r.leases END;
    -- protocol.live_leases, for release, renew and a start on a queue with max_running
    v_live := '{}';
    FOR v_i IN 1 .. v_n / 3 LOOP
        IF v_leases[3 * v_i - 1] > v_now THEN
            v_live := v_live || v_leases[3 * v_i - 2 : 3 * v_i];
        END IF;
    END LOOP;
    -- the live lease named by p_token (a call retried after its reply was lost is answered with
    -- the start it made): v_found, and its index in v_live, v_own
    v_found := false;
    IF p_token > 0 THEN
        FOR v_i IN 1 .. cardinality(v_live) / 3 LOOP
            IF v_live[3 * v_i] = p_token THEN
                v_found := true; v_own := v_i;
            END IF;
        END LOOP;
    END IF;

    IF (p_op = 'take_and_try' OR p_op = 'try_take') AND v_found THEN
        -- protocol.take_and_try, asked again with the token of a live lease: its start again
        -- (protocol.enqueue_and_try and try_take as well)
        o_kind := 'started'; o_a := v_live[3 * v_own - 2]; o_b := v_live[3 * v_own - 1] - p_lease;
    ELSIF r.fair AND (p_op = 'take' OR p_op = 'try_start' OR p_op = 'take_and_try' OR p_op = 'try_take') THEN
        v_fair := true;
        v_number := r.number; v_begun := r.begun; v_waiters := r.waiters; v_tenants := r.tenants;
        IF p_op = 'try_start' THEN
            v_asked := p_ticket;
        ELSE
            -- protocol.enqueue: G4's jump, as take's (of cost 0); then a new waiter, numbered, at the
            -- back, without a ticket, and the waiters seated
            IF v_ticket - 1 > v_pos
               AND v_from + (v_ticket - 1 - v_pos)::numeric * v_step + v_step <= v_now
               AND v_held + c_full_grace <= v_now THEN
                v_pos := v_ticket - 1;
            END IF;
            IF v_number + 1 >= c_limit THEN
                o_kind := 'unwritten_number'; o_a := v_number;
                RETURN NEXT;
                RETURN;
            END IF;
            v_asked := v_number; v_number := v_number + 1;
            v_waiters := v_waiters || ARRAY[v_asked, p_weight, p_cost, 0];
            v_tenants := v_tenants || p_tenant;
            -- protocol._seated: the waiters whose tickets were passed (at or below pos) leave; then each
            -- waiter without a ticket, in order, gets the next (taking its cost's numbers, as take) while its
            -- tenant holds fewer tickets than its weight
            v_kw := '{}'; v_kt := '{}'; v_ht := '{}'; v_hc := '{}';
            FOR v_i IN 1 .. coalesce(cardinality(v_tenants), 0) LOOP
                CONTINUE WHEN v_waiters[4 * v_i] > 0 AND v_waiters[4 * v_i] <= v_pos;
                IF v_waiters[4 * v_i] > 0 THEN
                    v_j := array_position(v_ht, v_tenants[v_i]);
                    IF v_j IS NULL THEN
                        v_ht := v_ht || v_tenants[v_i]; v_hc := v_hc || 1::bigint;
                    ELSE
                        v_hc[v_j] := v_hc[v_j] + 1;
                    END IF;
                END IF;
                v_kw := v_kw || v_waiters[4 * v_i - 3 : 4 * v_i]; v_kt := v_kt || v_tenants[v_i];
            END LOOP;
            FOR v_i IN 1 .. coalesce(cardinality(v_kt), 0) LOOP
                CONTINUE WHEN v_kw[4 * v_i] <> 0;
                v_j := array_position(v_ht, v_kt[v_i]);
                IF coalesce(v_hc[v_j], 0) < v_kw[4 * v_i - 2] THEN
                    IF v_ticket::numeric + v_kw[4 * v_i - 1] >= c_limit THEN
                        o_kind := 'unwritten_ticket'; o_a := v_ticket;
                        RETURN NEXT;
                        RETURN;
                    END IF;
                    v_kw[4 * v_i] := v_ticket; v_ticket := v_ticket + v_kw[4 * v_i - 1];
                    IF v_j IS NULL THEN
                        v_ht := v_ht || v_kt[v_i]; v_hc := v_hc || 1::bigint;
                    ELSE
                        v_hc[v_j] := v_hc[v_j] + 1;
                    END IF;
                END IF;
            END LOOP;
            v_waiters := v_kw; v_tenants := v_kt;
            IF p_op = 'take' THEN
                o_kind := 'taken'; o_a := v_asked; o_b := v_pos; o_c := v_at;
            END IF;
        END IF;
        IF p_op <> 'take' THEN
            -- protocol.try_turn of waiter v_asked: the waiter that started last, asked again while
            -- its start's interval lasts, is answered that start again, as is a live lease's token
            IF v_asked = v_begun AND v_pos < v_ticket AND v_now < v_at + r.interval_us THEN
                o_kind := 'started'; o_a := v_pos; o_b := v_at;
            ELSIF v_found THEN
                o_kind := 'started'; o_a := v_live[3 * v_own - 2]; o_b := v_live[3 * v_own - 1] - p_lease;
            ELSE
                v_me := NULL;
                FOR v_i IN 1 .. coalesce(cardinality(v_tenants), 0) LOOP
                    IF v_waiters[4 * v_i - 3] = v_asked THEN
                        v_me := v_i;
                        EXIT;
                    END IF;
                END LOOP;
                IF v_me IS NULL THEN -- not in line (started, passed or never numbered): take a new number
                    o_kind := 'passed'; o_a := v_asked; o_b := v_pos;
                ELSIF v_waiters[4 * v_me] = 0 THEN
                    -- no ticket yet: wait until the tenant's first ticket may start (Record.earliest,
                    -- its slot counted at the slowest pace) or a step from now, whichever is later
                    v_t := 0;
                    FOR v_i IN 1 .. cardinality(v_tenants) LOOP
                        IF v_tenants[v_i] = v_tenants[v_me] AND v_waiters[4 * v_i] <> 0
                           AND (v_t = 0 OR v_waiters[4 * v_i] < v_t) THEN
                            v_t := v_waiters[4 * v_i];
                        END IF;
                    END LOOP;
                    IF v_t > v_pos THEN
                        v_slowest := greatest(r.interval_us, v_pace);
                        v_earliest := greatest(greatest(v_due::numeric, v_not_before::numeric - v_slowest)
                                                   + (v_t - v_pos)::numeric * v_slowest
                                                   - (r.burst - p_cost)::numeric * r.interval_us,
                                               v_at, v_not_before);
                    ELSE
                        v_earliest := v_now + v_step;
                    END IF;
                    IF r.burst = 1 THEN -- an interval more for each of its tenant's waiters without a ticket before it
                        FOR v_i IN 1 .. v_me - 1 LOOP
                            IF v_tenants[v_i] = v_tenants[v_me] AND v_waiters[4 * v_i] = 0 THEN
                                v_earliest := v_earliest + r.interval_us;
                            END IF;
                        END LOOP;
                    END IF;
                    o_kind := 'wait'; o_a := v_asked; o_b := greatest(v_earliest, v_now + v_step);
                ELSE
                    v_t := v_waiters[4 * v_me]; v_try := true; -- its ticket, tried as try_start tries it
                END IF;
            END IF;
        END IF;
    ELSIF p_op = 'take' OR p_op = 'take_and_try' OR p_op = 'try_take' THEN
        -- protocol.take: pos jumps to the last ticket handed out when every ticket since pos is at
        -- least one step past its slot (counted from v_from: a hold moves the slots to its end; a
        -- slow-down counts them at the effective interval, v_step), and no earlier one waits for a place
        IF v_ticket + p_cost >= c_limit THEN
            o_kind := 'unwritten_ticket'; o_a := v_ticket;
            RETURN NEXT;
            RETURN;
        END IF;
        IF v_ticket - 1 > v_pos
           AND v_from + (v_ticket - 1 - v_pos)::numeric * v_step + v_step <= v_now
           AND v_held + c_full_grace <= v_now THEN
            v_pos := v_ticket - 1;
        END IF;
        v_t := v_ticket;
        v_ticket := v_ticket + p_cost;
        IF p_op = 'take' THEN
            o_kind := 'taken'; o_a := v_t; o_b := v_pos; o_c := v_at;
        END IF;
    END IF;

    IF ((p_op = 'take_and_try' OR p_op = 'try_take') AND v_found) OR (v_fair AND NOT v_try) THEN
        NULL; -- answered above
    ELSIF p_op = 'try_start' OR p_op = 'take_and_try' OR p_op = 'try_take' THEN
        IF p_op = 'try_start' AND NOT v_fair THEN
            v_t := p_ticket;
        END IF;
        v_lead := p_lead; v_cost := p_cost;
        -- protocol.try_start
        IF v_pos = v_t AND v_t < v_ticket AND v_now < v_at + r.interval_us THEN
            o_kind := 'started'; o_a := v_t; o_b := v_at; -- the latest start asked for again
        ELSIF v_found AND v_live[3 * v_own - 2] = v_t THEN
            -- asked again with its lease's token: the same start
            o_kind := 'started'; o_a := v_t; o_b := v_live[3 * v_own - 1] - p_lease;
        ELSIF v_pos >= v_t OR v_t >= v_ticket THEN
            o_kind := 'passed'; o_a := v_t; o_b := v_pos;
        ELSE
            -- the strict slot, counted from v_from at the effective interval; never before the latest
            -- start, nor the hold's end
            v_strict := v_from + (v_t - v_pos)::numeric * v_step;
            v_earliest := greatest(v_strict - (r.burst - v_cost)::numeric * r.interval_us, v_at, v_not_before);
            IF v_t > v_pos + 1 THEN -- it would pass the tickets between: not while they wait for a place
                v_earliest := greatest(v_earliest, v_held + c_full_grace);
            END IF;
            IF v_paused THEN
                o_kind := 'wait'; o_a := v_t; o_b := greatest(v_earliest, v_now + c_paused_recheck);
            ELSIF v_now + v_lead < v_earliest THEN
                o_kind := 'wait'; o_a := v_t; o_b := v_earliest;
            ELSE
                IF r.max_running > 0 THEN
                    v_leases := v_live;
                END IF;
                IF r.max_running > 0 AND cardinality(v_leases) / 3 >= r.max_running THEN
                    -- full: wait for the first lease's expiry, or recheck; note when it was found full
                    v_recheck := v_now + c_full_recheck;
                    FOR v_i IN 1 .. cardinality(v_leases) / 3 LOOP
                        v_recheck := least(v_recheck, v_leases[3 * v_i - 1]);
                    END LOOP;
                    v_held := v_now;
                    o_kind := 'wait'; o_a := v_t; o_b := greatest(v_earliest, v_recheck);
                ELSE
                    v_start := greatest(v_earliest, v_now);
                    IF r.max_running > 0 THEN
                        v_leases := v_leases || ARRAY[v_t, v_start + p_lease, p_token];
                    END IF;
                    -- due: the later of the strict slot and the start, plus the starter's doubt
                    v_pos := v_t; v_at := v_start; v_due := greatest(v_strict, v_start) + p_doubt;
                    o_kind := 'started'; o_a := v_t; o_b := v_start;
                END IF;
            END IF;
        END IF;
        IF v_fair THEN
            -- protocol.try_turn, once its waiter's ticket was tried: started, the waiter leaves (and is
            -- the one begun); a wait or a pass names the waiter; a start or a pass seats the waiters
            IF o_kind = 'started' THEN
                v_waiters := v_waiters[1 : 4 * v_me - 4] || v_waiters[4 * v_me + 1 : cardinality(v_waiters)];
                v_tenants := v_tenants[1 : v_me - 1] || v_tenants[v_me + 1 : cardinality(v_tenants)];
                v_begun := v_asked;
            ELSE
                o_a := v_asked;
            END IF;
            IF o_kind <> 'wait' THEN
                -- protocol._seated: the waiters whose tickets were passed (at or below pos) leave; then each
                -- waiter without a ticket, in order, gets the next (taking its cost's numbers, as take) while its
                -- tenant holds fewer tickets than its weight
                v_kw := '{}'; v_kt := '{}'; v_ht := '{}'; v_hc := '{}';
                FOR v_i IN 1 .. coalesce(cardinality(v_tenants), 0) LOOP
                    CONTINUE WHEN v_waiters[4 * v_i] > 0 AND v_waiters[4 * v_i] <= v_pos;
                    IF v_waiters[4 * v_i] > 0 THEN
                        v_j := array_position(v_ht, v_tenants[v_i]);
                        IF v_j IS NULL THEN
                            v_ht := v_ht || v_tenants[v_i]; v_hc := v_hc || 1::bigint;
                        ELSE
                            v_hc[v_j] := v_hc[v_j] + 1;
                        END IF;
                    END IF;
                    v_kw := v_kw || v_waiters[4 * v_i - 3 : 4 * v_i]; v_kt := v_kt || v_tenants[v_i];
                END LOOP;
                FOR v_i IN 1 .. coalesce(cardinality(v_kt), 0) LOOP
                    CONTINUE WHEN v_kw[4 * v_i] <> 0;
                    v_j := array_position(v_ht, v_kt[v_i]);
                    IF coalesce(v_hc[v_j], 0) < v_kw[4 * v_i - 2] THEN
                        IF v_ticket::numeric + v_kw[4 * v_i - 1] >= c_limit THEN
                            o_kind := 'unwritten_ticket'; o_a := v_ticket;
                            RETURN NEXT;
                            RETURN;
                        END IF;
                        v_kw[4 * v_i] := v_ticket; v_ticket := v_ticket + v_kw[4 * v_i - 1];
                        IF v_j IS NULL THEN
                            v_ht := v_ht || v_kt[v_i]; v_hc := v_hc || 1::bigint;
                        ELSE
                            v_hc[v_j] := v_hc[v_j] + 1;
                        END IF;
                    END IF;
                END LOOP;
                v_waiters := v_kw; v_tenants := v_kt;
            END IF;
        END IF;
    ELSIF p_op = 'retime' THEN
        -- protocol.retime: the latest start moves to now + lead at the earliest, its lease and due
        -- with it (due by as much as the start, so that a doubt or an overrun it holds stays)
        IF v_pos <> p_ticket OR p_ticket >= v_ticket THEN
            o_kind := 'passed'; o_a := p_ticket; o_b := v_pos;
        ELSE
            v_start := greatest(v_at, v_now + p_lead);
            FOR v_i IN 1 .. v_n / 3 LOOP
                IF v_leases[3 * v_i - 2] = p_ticket THEN
                    v_leases[3 * v_i - 1] := v_leases[3 * v_i - 1] + (v_start - v_at);
                END IF;
            END LOOP;
            v_due := greatest(v_due + (v_start - v_at), v_start + p_doubt); v_at := v_start;
            o_kind := 'started'; o_a := p_ticket; o_b := v_start;
        END IF;
    ELSIF p_op = 'set_paused' THEN
        -- protocol.set_paused: only the flag changes, and paused_at: now when a pause begins (one asked
        -- again keeps the first one's), NEVER on resume (one expression: every path is warmed up at once)
        o_kind := 'set'; o_a := CASE WHEN v_paused <> p_paused THEN 1 ELSE 0 END;
        v_paused_at := CASE WHEN v_paused = p_paused THEN v_paused_at
                            WHEN p_paused THEN v_now ELSE c_never END;
        v_paused := p_paused;
    ELSIF p_op = 'hold' THEN
        -- protocol.hold: no start before now + lead; a hold only grows
        o_kind := 'set';
        IF v_now + p_lead <= v_not_before THEN
            o_a := 0;
        ELSE
            o_a := 1; v_not_before := v_now + p_lead;
        END IF;
    ELSIF p_op = 'lift' THEN
        -- protocol.lift: no hold; whether one was on at now
        o_kind := 'set';
        IF v_not_before = c_never THEN
            o_a := 0;
        ELSE
            o_a := CASE WHEN v_not_before > v_now THEN 1 ELSE 0 END; v_not_before := c_never;
        END IF;
    ELSIF p_op = 'slow' THEN
        -- protocol.slow: the pace becomes p_lead (0: twice the effective interval), at most MAX_SLOW
        -- intervals and so that burst slots of it stay below LIMIT; only if slower than the effective
        -- interval now, from which it recovers by itself
        o_kind := 'set';
        v_t := least(CASE WHEN p_lead > 0 THEN p_lead ELSE 2 * v_step END, c_max_slow * r.interval_us,
                     (c_limit - 1) / r.burst);
        IF v_t <= v_step THEN
            o_a := 0;
        ELSE
            o_a := 1; v_pace := v_t; v_paced_at := v_now;
        END IF;
    ELSIF p_op = 'settle' THEN
        -- protocol.settle: the job of ticket p_ticket, started for p_cost, cost p_lead. An overrun moves
        -- due on by the excess at the effective interval, to at + (burst - 1) slowest paces at most;
        -- a refund moves it back by the saving at the interval, never below at + (pos - ticket -
        -- estimate) intervals. Nothing for a ticket not started, a record that never started one, the
        -- ticket that settled last, or an exact estimate (in numeric: the bound a refund may not pass
        -- can lie far off); nor for an overrun when a doubt already put due past its cap (never back)
        o_kind := 'set'; o_a := 0;
        IF 0 < p_ticket AND p_ticket <= v_pos AND v_at <> c_never AND p_ticket <> v_settled
           AND p_lead <> p_cost THEN
            IF p_lead > p_cost THEN
                v_moved := least(v_due::numeric + (p_lead - p_cost)::numeric * v_step,
                                 v_at::numeric + (r.burst - 1)::numeric
                                                 * least(c_max_slow::numeric * r.interval_us,
                                                         (c_limit - 1) / r.burst));
                IF v_moved > v_due THEN
                    o_a := 1;
                END IF;
            ELSE
                v_moved := greatest(v_due::numeric - (p_cost - p_lead)::numeric * r.interval_us,
                                    v_at::numeric + (v_pos - p_ticket - p_cost)::numeric * r.interval_us);
                IF v_moved < v_due THEN
                    o_a := 1;
                END IF;
            END IF;
            IF o_a = 1 THEN
                v_due := v_moved; v_settled := p_ticket;
            END IF;
        END IF;
    ELSIF p_op = 'release' THEN
        -- protocol.release: drop the ticket's lease named by p_token, and the expired ones; whether
        -- it was live
        v_kept := '{}';
        FOR v_i IN 1 .. cardinality(v_live) / 3 LOOP
            IF v_live[3 * v_i - 2] <> p_ticket OR v_live[3 * v_i] <> p_token THEN
                v_kept := v_kept || v_live[3 * v_i - 2 : 3 * v_i];
            END IF;
        END LOOP;
        o_kind := 'live'; o_a := CASE WHEN cardinality(v_kept) < cardinality(v_live) THEN 1 ELSE 0 END;
        v_leases := v_kept;
        -- a place freed while a ticket may wait for one
        v_freed := o_a = 1 AND v_held + c_full_grace > v_now;
    ELSIF p_op = 'renew' THEN
        -- protocol.renew: the ticket's live lease named by p_token lasts until now + lease at least;
        -- expired ones go
        v_found := false;
        FOR v_i IN 1 .. cardinality(v_live) / 3 LOOP
            IF v_live[3 * v_i - 2] = p_ticket AND v_live[3 * v_i] = p_token THEN
                v_live[3 * v_i - 1] := greatest(v_live[3 * v_i - 1], v_now + p_lease);
                v_found := true;
            END IF;
        END LOOP;
        v_leases := v_live;
        o_kind := 'live'; o_a := CASE WHEN v_found THEN 1 ELSE 0 END;
    ELSIF p_op <> 'take' AND p_op <> 'take_and_try' AND p_op <> 'try_take' THEN
        RAISE EXCEPTION 'ratequeue: unknown operation %', p_op;
    END IF;
    IF p_op = 'try_take' AND o_kind <> 'started' THEN
        -- protocol.try_take: take_and_try's answer, but nothing written (no ticket handed out, no
        -- waiter added, no jump, no full row noted, the keep time as it was)
        RETURN NEXT;
        RETURN;
    END IF;
    IF (p_op = 'try_start' OR p_op = 'take_and_try' OR p_op = 'try_take') AND o_kind = 'started'
       AND r.max_running > 0
       AND coalesce(cardinality(v_leases), 0) / 3 < r.max_running AND v_held + c_full_grace > v_now THEN
        v_freed := true; -- a place is left, and the next ticket, which the grace held back, may take it
    END IF;
    IF v_freed THEN -- tell the shards of other processes waiting for a place (freed.py)
        PERFORM pg_notify('ratequeue_freed_' || md5(convert_to('@TABLE@/' || p_name, 'UTF8')), '');
    END IF;

    -- the keep time (see ratequeue.state._local.keep_until): p_keep after the later of now and
    -- protocol.expires, the slot of the next ticket plus an interval (a hold moves it to the
    -- hold's end at least; a slow-down counts both at its slowest, the pace), the end of the grace
    -- after the queue was last found full, and every lease's expiry; none while paused
    IF p_keep > 0 AND NOT v_paused THEN
        v_slowest := greatest(r.interval_us, v_pace);
        v_expires := greatest(greatest(v_due::numeric, v_not_before::numeric - v_slowest)
                                  + (v_ticket - v_pos)::numeric * v_slowest + v_slowest,
                              v_held::numeric + c_full_grace);
        FOR v_i IN 1 .. coalesce(cardinality(v_leases), 0) / 3 LOOP
            v_expires := greatest(v_expires, v_leases[3 * v_i - 1]);
        END LOOP;
        v_keep_until := least(greatest(v_expires, v_now) + p_keep, c_keep_cap);
    ELSE
        v_keep_until := NULL;
    END IF;
    -- an answer that changes nothing (a wait, a repeated start) writes nothing
    IF v_ticket <> r.ticket OR v_pos <> r.pos OR v_at <> r.at_us OR v_due <> r.due_us
       OR v_paused <> r.paused
       OR v_paused_at <> (CASE WHEN r.paused THEN coalesce(r.paused_at_us, c_never) ELSE c_never END)
       OR v_leases <> r.leases OR v_held <> r.held_us
       OR v_not_before <> coalesce(r.not_before_us, c_never)
       OR v_pace <> coalesce(r.pace_us, 0) OR v_paced_at <> coalesce(r.paced_at_us, c_never)
       OR v_settled <> coalesce(r.settled, 0)
       OR v_keep_until IS DISTINCT FROM r.keep_until_us
       OR (v_fair AND (v_number <> r.number OR v_begun <> r.begun OR v_waiters <> r.waiters
                       OR v_tenants <> r.tenants)) THEN
        IF v_fair THEN
            UPDATE @TABLE@
            SET ticket = v_ticket, pos = v_pos, at_us = v_at, due_us = v_due, paused = v_paused,
                leases = v_leases, held_us = v_held, not_before_us = nullif(v_not_before, c_never),
                pace_us = v_pace, paced_at_us = nullif(v_paced_at, c_never), settled = v_settled,
                paused_at_us = nullif(v_paused_at, c_never), keep_until_us = v_keep_until,
                number = v_number, begun = v_begun, waiters = v_waiters, tenants = v_tenants
            WHERE name = p_name;
        ELSE
            UPDATE @TABLE@
            SET ticket = v_ticket, pos = v_pos, at_us = v_at, due_us = v_due, paused = v_paused,
                leases = v_leases, held_us = v_held, not_before_us = nullif(v_not_before, c_never),
                pace_us = v_pace, paced_at_us = nullif(v_paced_at, c_never), settled = v_settled,
                paused_at_us = nullif(v_paused_at, c_never), keep_until_us = v_keep_until
            WHERE name = p_name;
        END IF;
    END IF;
    RETURN NEXT;
END;
$ratequeue$
