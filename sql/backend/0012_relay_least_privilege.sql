-- The relay runs as a role of its own, and a producer needs no privilege on serversync's schema.
--
-- Why: the generated relay functions ran as whoever wrote a tracked table, so every role that
-- wrote one needed INSERT on sync.events_outbox, USAGE on the schema sync and on its sequences.
-- A role allowed to write one table could therefore insert any event it liked, a delete of any
-- entity of any type included, and the consumer signs and delivers what the outbox holds.
--
-- What changes:
--
-- * The generated functions (sync.relay_<oid> for upserts, sync.relay_delete_<oid> for deletes,
--   sync.rekey_<oid> for changed keys; a partitioned table's row triggers call the same two
--   relay functions) are SECURITY DEFINER with `SET search_path = pg_catalog, pg_temp`, the form
--   PostgreSQL's documentation gives for such functions ("Writing SECURITY DEFINER Functions
--   Safely"): pg_catalog first and the temporary schema last, so that neither a caller's
--   search_path nor a temporary object decides what a name in them means. Every object of
--   serversync they name is schema-qualified as well, and the empty-key check is called with
--   its exact argument types (regclass, text), so that no function added to the schema sync
--   with a closer match can stand in for it.
-- * They belong to serversync_relay, a NOLOGIN role that holds only what they use: USAGE on the
--   schema sync, INSERT on sync.events_outbox, USAGE on its sequence (the seq default), SELECT
--   on sync.waiting_consumers (the wake-up check, 0008), and, per tracked table, SELECT on its
--   key column for the rekey check. Roles belong to the cluster, not to a database: the role is
--   created only when missing, and a migration that finds it made by another database's
--   migration meanwhile carries on. The migrating role is made a member of it (GRANT
--   serversync_relay TO the migrating role), which PostgreSQL requires of whoever hands an
--   object to another role (ALTER FUNCTION ... OWNER TO).
-- * Without that role (the migrating role may not create roles, as on some managed services,
--   and nobody created it beforehand) or without membership in it, the generated functions stay
--   SECURITY DEFINER and belong to the role that runs sync.track, which owns the outbox: a
--   producer still needs no privilege on the schema sync, but the relay then runs with every
--   right of that role. sync.track says so in a NOTICE each time; docs/security.md says how to
--   create the role and grant it afterwards (run sync.track again, or migrate, to hand over).
-- * PostgreSQL also requires a function's new owner to have CREATE on the function's schema
--   when the one handing it over is no superuser. sync.track lends serversync_relay CREATE on
--   the schema sync for its ALTER FUNCTION statements only and takes it back in the same
--   transaction: no other transaction ever sees the role holding it.
-- * The rekey check (did another row take the old key by the end of the statement) reads the
--   user's table as serversync_relay: sync.track grants it SELECT on the key column, and adds
--   a policy sync_relay_rekey FOR SELECT TO serversync_relay USING (true), which lets it see
--   every row whether the table has row level security or gets it later (without one, a table
--   with row level security shows the role no row, the check finds no key taken, and keys
--   swapped in one statement of a partitioned table end with one of the two entities deleted).
--   It reads the tracked table by its oid, a partitioned one through its parent (the key is
--   the table's, not a partition's; the parent's privileges and policies are what count), and
--   compares with the equality operator the caller's search_path gives the key's type when
--   sync.track runs, schema-qualified (OPERATOR(pg_catalog.=) for every built-in type), where
--   it compared with whatever `=` the producer's search_path found.
-- * Only the owner of a table may track it, and sync.track refuses anyone else
--   (SQLSTATE 42501). It grants the relay role a column of the table and adds a policy to it,
--   both an owner's acts, and it is what decides which table's rows go out as which entity
--   type: a role that could track a table it does not own could have the relay send that
--   table's rows, or its own rows under another table's entity type. EXECUTE on sync.track and
--   sync.untrack is revoked from PUBLIC: the migrating role (their owner) calls them, and a
--   superuser. EXECUTE on the generated functions is revoked from PUBLIC too: a trigger fires
--   its function whatever the writer's privileges, while CREATE TRIGGER needs EXECUTE on it, so
--   no one can attach a relay function, whose entity type is written into it, to a table of
--   their own. (A trigger function cannot be called directly in any case.)
-- * No role but the outbox's owner and serversync_relay may write the outbox:
--   INSERT, UPDATE, DELETE, TRUNCATE and TRIGGER on it and every privilege on its sequence are
--   revoked from PUBLIC, and INSERT, UPDATE and TRIGGER on it (table or column grants) and
--   USAGE and UPDATE on its sequence from every other role that holds them. The README told
--   users to grant producers INSERT on the outbox; left in place, those grants would keep open
--   exactly what this migration closes, and no producer needs them any more (its writes reach
--   the outbox through the relay). TRIGGER goes too: a trigger on the outbox runs as the role
--   that inserts, now serversync_relay, so a role that could add one could run its own code
--   with the relay's rights. DELETE and TRUNCATE granted to a role are kept, with a NOTICE
--   naming it: `serversync cleanup` deletes outbox rows and may run as such a role, and a role
--   that can delete rows cannot make one up. USAGE on sync.waiting_consumers, which the README
--   told producers to hold for the wake-up check (0008), is revoked from every role: it lets a
--   role call nextval() on the count, and so make every producer send a NOTIFY until the next
--   recount; SELECT on it, and every grant on the schema sync, are left as they are (they let a
--   producer read names and a counter, and write nothing the consumer delivers).
-- * No code chosen by a role other than the table's owner runs inside the relay. to_json calls
--   a column type's cast to json, made by whoever owns the type (also for the element type of
--   an array, the base type of a domain, the attributes' types of a composite, recursively),
--   and the rekey check calls the key's `=` and evaluates the table's policies, all as
--   serversync_relay: a producer owning such a type, cast function or operator could have the
--   relay write any event. sync.track (through sync.relay_refusal) refuses, SQLSTATE 42501
--   with a HINT, a table where any of them belongs to a role that is no superuser, not the
--   table's owner and not a role the owner is a member of. The owner itself is trusted like
--   the migrating role (docs/security.md, Roles and grants).
-- * sync.track refuses a table with a RESTRICTIVE policy: the permissive sync_relay_rekey does
--   not override it, so it would run its code as serversync_relay and hide rows from the rekey
--   check, which then finds no key taken and, when keys are swapped in one statement of a
--   partitioned table, sends a delete of a live entity. sync.track cannot stop one being added
--   later: the rekey check then refuses the key change (SQLSTATE 42501, the producer's
--   statement fails) before the policy is read, whenever a RESTRICTIVE policy for SELECT
--   applies to it; other writes are relayed as before. Failing the write was chosen over a
--   check that sees only part of the table (a wrong delete downstream) and over skipping the
--   check.
-- * The regeneration at the end of this migration does not fail for a table tracked before
--   that sync.track now refuses: it removes that table's relay (sync.untrack) with a WARNING
--   naming the table, why, and the sync.track call to run once fixed. Until then the table's
--   writes are NOT relayed. Its old relay could not stay: it ran as the writer, which this
--   migration takes the outbox away from.
-- * sync.refuse_empty_key gets the same fixed search_path: it names no object, and its message
--   names the table schema-qualified whatever the caller's search_path ("a row of
--   public.gadgets has an empty or NULL key"). It needs no SECURITY DEFINER, having nothing to
--   read or write, and keeps EXECUTE for PUBLIC (calling it only raises). The first relay of
--   0001, sync.relay(), which no trigger sync.track makes uses since 0005, loses EXECUTE for
--   PUBLIC.
--
-- What it costs a producer. Instructions the relay adds to a single-row statement that is its
-- own transaction (`python -m bench instructions`, bigint key; thousands). The bench writes as a
-- superuser; the second pair of columns writes as a role with only its table's privileges (and,
-- for 0011, the outbox grants it then needed), measured the same way:
--                                                   superuser        producer role
--                                                 INSERT  UPDATE    INSERT  UPDATE
--   0011                                            89.5    86.4      95.7    92.8
--   SECURITY DEFINER alone                         102.1    99.0     105.4   100.2
--   and SET search_path = pg_catalog, pg_temp
--   (0012)                                         110.3   107.7     114.1   108.8
--   for scale: the untracked statement             125.1   166.3     127.4   167.9
-- Running as another role costs ~10k a call: PostgreSQL switches the user id and, the default
-- search_path naming "$user", computes the search path again on the way in and out; ACL checks
-- then look up another role. The SET clause costs ~8.5k more: PostgreSQL 15 saves the setting
-- and, at the function's end, walks every configuration variable to restore it (AtEOXact_GUC,
-- ~3.4k alone), and parses the path again. A producer's single-row INSERT costs 8 % more in all
-- (223.1k to 241.5k), an UPDATE 6 % (260.7k to 276.8k).
-- Left out: the SET clause, with every name in the generated code qualified instead
-- (pg_catalog.to_json, OPERATOR(pg_catalog.=), no NULLIF, whose `=` cannot be qualified,
-- pg_catalog.bool for the variables PL/pgSQL declares, the table's name built from pg_class
-- rather than from regclass output, which depends on the search_path). It would save ~8.5k a
-- statement, but then the relay's safety rests on every name in it, now and in whatever
-- sync.track generates later, being qualified: one that is not lets any producer, through a
-- function or operator of its own first in its search_path, run code as serversync_relay and
-- write any event, which is what this migration closes. With the SET clause a name left
-- unqualified still resolves in pg_catalog. (PostgreSQL 16 and later restore only the
-- variables a function changed, which makes the clause much cheaper there.)
--
-- The relay of every tracked table is generated again, and handed to serversync_relay.

DO $role$
DECLARE
    superuser boolean := (SELECT r.rolsuper FROM pg_catalog.pg_roles r
                           WHERE r.rolname = current_user);
BEGIN
    IF to_regrole('serversync_relay') IS NULL THEN
        BEGIN
            CREATE ROLE serversync_relay NOLOGIN;
        EXCEPTION
            WHEN duplicate_object OR unique_violation THEN
                NULL;  -- the migration of another database of the cluster made it meanwhile
            WHEN insufficient_privilege THEN
                RAISE NOTICE 'serversync: % may not create roles, and role serversync_relay is '
                             'missing: the relay runs as % (docs/security.md, Roles and grants)',
                             current_user, current_user;
                RETURN;
        END;
    END IF;
    IF NOT superuser AND NOT pg_has_role(current_user, 'serversync_relay', 'USAGE') THEN
        BEGIN
            GRANT serversync_relay TO CURRENT_USER;
        EXCEPTION
            WHEN unique_violation THEN
                NULL;  -- granted meanwhile by the migration of another database
            WHEN insufficient_privilege THEN
                RAISE NOTICE 'serversync: % may not become a member of role serversync_relay: '
                             'the relay runs as % (docs/security.md, Roles and grants)',
                             current_user, current_user;
        END;
    END IF;
END
$role$;

DO $grants$
BEGIN
    IF to_regrole('serversync_relay') IS NOT NULL THEN
        GRANT USAGE ON SCHEMA sync TO serversync_relay;
        GRANT INSERT ON sync.events_outbox TO serversync_relay;
        GRANT USAGE ON SEQUENCE sync.events_outbox_seq_seq TO serversync_relay;
        GRANT SELECT ON SEQUENCE sync.waiting_consumers TO serversync_relay;
    END IF;
END
$grants$;

REVOKE INSERT, UPDATE, DELETE, TRUNCATE, TRIGGER ON sync.events_outbox FROM PUBLIC;
REVOKE ALL ON SEQUENCE sync.events_outbox_seq_seq FROM PUBLIC;

DO $revoke$
DECLARE
    holder text;
BEGIN
    -- Roles other than the owner and the relay's that may write the outbox or attach a trigger
    -- to it (a column grant of INSERT or UPDATE is enough to write), or take its positions.
    FOR holder IN
        SELECT DISTINCT a.grantee::regrole::text
          FROM pg_catalog.pg_class c
               CROSS JOIN LATERAL pg_catalog.aclexplode(c.relacl) a
         WHERE c.oid = 'sync.events_outbox'::regclass
           AND a.privilege_type IN ('INSERT', 'UPDATE', 'TRIGGER')
           AND a.grantee NOT IN (0, c.relowner)
           AND a.grantee::regrole::text <> 'serversync_relay'
        UNION
        SELECT a.grantee::regrole::text
          FROM pg_catalog.pg_attribute t
               CROSS JOIN LATERAL pg_catalog.aclexplode(t.attacl) a
         WHERE t.attrelid = 'sync.events_outbox'::regclass
           AND a.privilege_type IN ('INSERT', 'UPDATE')
           AND a.grantee <> 0
           AND a.grantee::regrole::text <> 'serversync_relay'
    LOOP
        EXECUTE format('REVOKE INSERT, UPDATE, TRIGGER ON sync.events_outbox FROM %s', holder);
        RAISE NOTICE 'serversync: revoked INSERT, UPDATE and TRIGGER on sync.events_outbox from '
                     '%: the relay writes the outbox as serversync_relay', holder;
    END LOOP;
    FOR holder IN
        SELECT DISTINCT a.grantee::regrole::text
          FROM pg_catalog.pg_class c
               CROSS JOIN LATERAL pg_catalog.aclexplode(c.relacl) a
         WHERE c.oid = 'sync.events_outbox_seq_seq'::regclass
           AND a.privilege_type IN ('USAGE', 'UPDATE')
           AND a.grantee NOT IN (0, c.relowner)
           AND a.grantee::regrole::text <> 'serversync_relay'
    LOOP
        EXECUTE format('REVOKE USAGE, UPDATE ON SEQUENCE sync.events_outbox_seq_seq FROM %s',
                       holder);
    END LOOP;
    -- USAGE on the count of waiting consumers lets a role call nextval() on it; consumers and
    -- operators recount it with UPDATE (setval), the relay reads it with SELECT.
    FOR holder IN
        SELECT DISTINCT a.grantee::regrole::text
          FROM pg_catalog.pg_class c
               CROSS JOIN LATERAL pg_catalog.aclexplode(c.relacl) a
         WHERE c.oid = 'sync.waiting_consumers'::regclass
           AND a.privilege_type = 'USAGE'
           AND a.grantee NOT IN (0, c.relowner)
    LOOP
        EXECUTE format('REVOKE USAGE ON SEQUENCE sync.waiting_consumers FROM %s', holder);
    END LOOP;
    FOR holder IN
        SELECT DISTINCT a.grantee::regrole::text
          FROM pg_catalog.pg_class c
               CROSS JOIN LATERAL pg_catalog.aclexplode(c.relacl) a
         WHERE c.oid = 'sync.events_outbox'::regclass
           AND a.privilege_type IN ('DELETE', 'TRUNCATE')
           AND a.grantee NOT IN (0, c.relowner)
    LOOP
        RAISE NOTICE 'serversync: % keeps DELETE or TRUNCATE on sync.events_outbox (it can '
                     'delete events, not write them); revoke it unless it runs serversync cleanup',
                     holder;
    END LOOP;
    -- A grant made by a role other than the owner is revoked only by that role.
    IF EXISTS (
        SELECT 1
          FROM pg_catalog.pg_class c
               CROSS JOIN LATERAL pg_catalog.aclexplode(c.relacl) a
         WHERE c.oid = 'sync.events_outbox'::regclass
           AND a.privilege_type IN ('INSERT', 'UPDATE', 'TRIGGER')
           AND a.grantee NOT IN (0, c.relowner)
           AND a.grantee::regrole::text <> 'serversync_relay'
    ) THEN
        RAISE WARNING 'serversync: some role other than serversync_relay still may write '
                      'sync.events_outbox (granted by a role other than its owner): '
                      'see \dp sync.events_outbox';
    END IF;
END
$revoke$;

ALTER FUNCTION sync.refuse_empty_key(regclass, text) SET search_path = pg_catalog, pg_temp;
REVOKE EXECUTE ON FUNCTION sync.relay() FROM PUBLIC;

-- The key of a row as its JSON text, as an expression of the generated relay (0011). Changed:
-- the empty-key check is called with its exact argument types.
CREATE OR REPLACE FUNCTION sync.relay_key_expression(target regclass, key_column text,
                                                     row_ref text)
RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE
               WHEN a.attnotnull
                    AND t.oid IN ('int2'::regtype, 'int4'::regtype, 'int8'::regtype,
                                  'uuid'::regtype)
               THEN format('%s.%I::text', row_ref, key_column)
               WHEN a.attnotnull AND t.typcategory IN ('N', 'D', 'B', 'T', 'E')
               THEN format('to_json(%s.%I) #>> %L', row_ref, key_column, '{}')
               WHEN t.oid IN ('text'::regtype, 'varchar'::regtype)
               THEN format(
                   'coalesce(nullif(%s.%I::text, %L), '
                   'sync.refuse_empty_key(TG_RELID::regclass, %L::text))',
                   row_ref, key_column, '', key_column
               )
               ELSE format(
                   'coalesce(nullif(to_json(%s.%I) #>> %L, %L), '
                   'sync.refuse_empty_key(TG_RELID::regclass, %L::text))',
                   row_ref, key_column, '{}', '', key_column
               )
           END
      FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
     WHERE a.attrelid = target AND a.attname = key_column AND a.attnum > 0
       AND NOT a.attisdropped;
$$;

-- Why sync.track refuses a table, as {message, hint}, or NULL when it does not. Code chosen by
-- a role other than the table's owner must never run inside the relay, which runs as
-- serversync_relay: to_json calls a column type's cast to json (one made by whoever owns the
-- type, with a function of anyone's), for an array, domain or composite type that of its
-- element, base or attribute types too; the rekey check calls the key's `=` operator and reads
-- the table under its row level security policies. Trusted: superusers, the table's owner and
-- the roles it is a member of. A RESTRICTIVE policy is refused whoever owns what it calls: the
-- permissive policy sync_relay_rekey does not override it, and a rekey check that cannot see
-- every row finds no key taken and sends a delete of a live entity.
CREATE OR REPLACE FUNCTION sync.relay_refusal(target regclass, key_column text)
RETURNS text[]
LANGUAGE plpgsql STABLE AS $$
DECLARE
    table_owner oid := (SELECT c.relowner FROM pg_class c WHERE c.oid = target);
    found record;
    key_type text;
    equals oid;
BEGIN
    FOR found IN
        WITH RECURSIVE types(column_name, type_oid) AS (
            SELECT a.attname::text, a.atttypid
              FROM pg_attribute a
             WHERE a.attrelid = target AND a.attnum > 0 AND NOT a.attisdropped
            UNION
            SELECT t.column_name, inner_type.oid
              FROM types t
                   JOIN pg_type ty ON ty.oid = t.type_oid
                   CROSS JOIN LATERAL (
                       SELECT ty.typelem WHERE ty.typelem <> 0             -- array elements
                       UNION ALL
                       SELECT ty.typbasetype WHERE ty.typtype = 'd'        -- a domain's base
                       UNION ALL
                       SELECT a.atttypid FROM pg_attribute a               -- a composite's
                        WHERE ty.typtype = 'c' AND a.attrelid = ty.typrelid
                          AND a.attnum > 0 AND NOT a.attisdropped
                       UNION ALL
                       SELECT r.rngsubtype FROM pg_range r                 -- a range's
                        WHERE r.rngtypid = ty.oid OR r.rngmultitypid = ty.oid
                   ) AS inner_type(oid)
        ),
        -- What runs for each type: the type itself (its owner makes its casts) and the
        -- functions of its casts to json and jsonb.
        owned(column_name, what, owner) AS (
            SELECT t.column_name, format('its type %s', ty.oid::regtype), ty.typowner
              FROM types t JOIN pg_type ty ON ty.oid = t.type_oid
            UNION ALL
            SELECT t.column_name,
                   format('the cast of its type %s to %s, function %s', c.castsource::regtype,
                          c.casttarget::regtype, p.oid::regprocedure),
                   p.proowner
              FROM types t
                   JOIN pg_cast c ON c.castsource = t.type_oid
                                 AND c.casttarget IN ('json'::regtype, 'jsonb'::regtype)
                   JOIN pg_proc p ON p.oid = c.castfunc
        )
        SELECT o.column_name, o.what, o.owner::regrole::text AS owner
          FROM owned o JOIN pg_roles r ON r.oid = o.owner
         WHERE NOT r.rolsuper AND NOT pg_has_role(table_owner, o.owner, 'MEMBER')
         ORDER BY o.column_name, o.what
         LIMIT 1
    LOOP
        RETURN ARRAY[
            format('sync.track: column %I of table %s: %s belongs to role %s, which is neither '
                   'a superuser nor the table''s owner: the relay would run its code as '
                   'serversync_relay', found.column_name, target, found.what, found.owner),
            format('Have %s owned by the table''s owner or a superuser (ALTER TYPE ... OWNER TO, '
                   'ALTER FUNCTION ... OWNER TO, or DROP CAST), or change the column''s type, '
                   'then track the table again.', found.what)
        ];
    END LOOP;
    -- The key's equality operator, as sync.track picks it (the caller's search_path).
    SELECT format_type(a.atttypid, NULL) INTO key_type
      FROM pg_attribute a
     WHERE a.attrelid = target AND a.attname = key_column AND a.attnum > 0
       AND NOT a.attisdropped;
    equals := to_regoperator(format('=(%s,%s)', key_type, key_type));
    FOR found IN
        SELECT format('operator %s', o.oid::regoperator) AS what, o.oprowner::regrole::text AS owner
          FROM pg_operator o JOIN pg_roles r ON r.oid = o.oprowner
         WHERE o.oid = equals AND NOT r.rolsuper AND NOT pg_has_role(table_owner, o.oprowner, 'MEMBER')
        UNION ALL
        SELECT format('function %s of operator %s', p.oid::regprocedure, o.oid::regoperator),
               p.proowner::regrole::text
          FROM pg_operator o JOIN pg_proc p ON p.oid = o.oprcode
               JOIN pg_roles r ON r.oid = p.proowner
         WHERE o.oid = equals AND NOT r.rolsuper AND NOT pg_has_role(table_owner, p.proowner, 'MEMBER')
         LIMIT 1
    LOOP
        RETURN ARRAY[
            format('sync.track: key column %I of table %s: the rekey check compares it with %s, '
                   'which belongs to role %s, neither a superuser nor the table''s owner: the '
                   'relay would run its code as serversync_relay',
                   key_column, target, found.what, found.owner),
            'Give it to the table''s owner or a superuser, or set a search_path in which `=` '
            'for the key''s type is a trusted operator, then track the table again.'
        ];
    END LOOP;
    FOR found IN
        SELECT p.polname FROM pg_policy p
         WHERE p.polrelid = target AND NOT p.polpermissive
         ORDER BY p.polname LIMIT 1
    LOOP
        RETURN ARRAY[
            format('sync.track: table %s has the RESTRICTIVE policy %I: the rekey check must see '
                   'every row of the table, and the relay would run the policy''s code as '
                   'serversync_relay', target, found.polname),
            'Drop the policy, or make it PERMISSIVE, then track the table again.'
        ];
    END LOOP;
    RETURN NULL;
END;
$$;

CREATE OR REPLACE FUNCTION sync.track(
    target      regclass,
    entity_type text,
    key_column  text DEFAULT 'id'
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    relay text := format('sync.%I', 'relay_' || target::oid);
    relay_delete text := format('sync.%I', 'relay_delete_' || target::oid);
    rekey text := format('sync.%I', 'rekey_' || target::oid);
    -- The wake-up that follows the outbox INSERT (0002, 0008, 0009); its %s is 'FOUND AND ' in
    -- a statement trigger, which wakes nobody when its statement changed no row, and empty in a
    -- row trigger.
    wake_up text := $wake$
            IF %s(pg_sequence_last_value('sync.waiting_consumers') > 0
                  OR current_setting('sync.notify', true) = 'always') THEN
                IF coalesce(current_setting('sync.notify', true), '') <> 'off' THEN
                    PERFORM pg_notify('sync_outbox', '');  -- a wake-up only: no event data
                END IF;
            END IF;$wake$;
    -- Every generated function runs as its owner, with a search_path no caller can change.
    create_function text := 'CREATE OR REPLACE FUNCTION %s() RETURNS trigger LANGUAGE plpgsql '
                            'SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS %L';
    definer text := current_user;
    as_relay boolean := false;
    lend_create boolean;
    table_owner oid;
    table_schema text;
    qualified text;
    partitioned boolean;
    key_named text;
    key_type text;
    key_equals text;
    equals_schema text;
    needed_schema text;
    template text;
    new_row text;
    old_row text;
    body text;
    refusal text[];
BEGIN
    IF entity_type IS NULL OR entity_type !~ '^[A-Za-z_][A-Za-z0-9_.-]{0,127}$' THEN
        RAISE EXCEPTION 'sync.track: entity type % is not an identifier', quote_literal(entity_type)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF sync.relay_key_expression(target, key_column, 'r') IS NULL THEN
        RAISE EXCEPTION 'sync.track: table % has no column %', target, quote_ident(key_column)
            USING ERRCODE = 'undefined_column';
    END IF;
    SELECT format('%I.%I', n.nspname, c.relname), n.nspname, c.relkind = 'p', c.relowner
      INTO qualified, table_schema, partitioned, table_owner
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = target;
    -- Tracking decides which rows go out as which entity type, and grants the relay's role a
    -- column of the table: only the table's owner (or a role with its privileges) may do it.
    IF NOT pg_has_role(current_user, table_owner, 'USAGE') THEN
        RAISE EXCEPTION 'sync.track: only the owner of table % may track it', target
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    -- No code of a role other than the table's owner may run inside the relay.
    refusal := sync.relay_refusal(target, key_column);
    IF refusal IS NOT NULL THEN
        RAISE EXCEPTION '%', refusal[1]
            USING ERRCODE = 'insufficient_privilege', HINT = refusal[2];
    END IF;
    -- Who the generated functions run as: serversync_relay, when it exists and the caller may
    -- hand objects to it; else the caller, which must then be able to write the outbox.
    IF to_regrole('serversync_relay') IS NOT NULL THEN
        as_relay := pg_has_role(current_user, 'serversync_relay', 'USAGE');
    END IF;
    IF as_relay THEN
        definer := 'serversync_relay';
    ELSE
        IF NOT has_table_privilege('sync.events_outbox', 'INSERT') THEN
            RAISE EXCEPTION 'sync.track: % may neither act as role serversync_relay nor write '
                            'sync.events_outbox', current_user
                USING ERRCODE = 'insufficient_privilege',
                      HINT = 'Run sync.track as the role that ran serversync migrate.';
        END IF;
        RAISE NOTICE 'sync.track: the relay of % runs as %: role serversync_relay is missing or '
                     '% may not act as it (docs/security.md, Roles and grants)',
                     target, current_user, current_user;
    END IF;
    -- The rekey check compares keys with the equality operator the caller's search_path gives
    -- the key's type now, schema-qualified: the check runs with search_path pg_catalog.
    SELECT format_type(a.atttypid, NULL) INTO key_type
      FROM pg_attribute a
     WHERE a.attrelid = target AND a.attname = key_column AND a.attnum > 0
       AND NOT a.attisdropped;
    SELECT format('OPERATOR(%I.%s)', n.nspname, o.oprname), n.nspname
      INTO key_equals, equals_schema
      FROM pg_operator o JOIN pg_namespace n ON n.oid = o.oprnamespace
     WHERE o.oid = to_regoperator(format('=(%s,%s)', key_type, key_type));
    IF key_equals IS NULL THEN
        -- No operator of exactly that type (varchar, a domain): PostgreSQL's own choice among
        -- the built-in ones.
        key_equals := 'OPERATOR(pg_catalog.=)';
        equals_schema := 'pg_catalog';
    END IF;
    PERFORM sync.drop_relay_triggers(target);
    -- The bodies go in as quoted literals (%L), not dollar-quoted: no name can end them. One
    -- function for upserts and one for deletes, each with no branch to take (0009). Their SQL
    -- names every column through its row, r, NEW or OLD, and a row as a whole as r.* (a bare r
    -- would be a column named r); any other bare name is one of PL/pgSQL's (TG_RELID), which
    -- `#variable_conflict use_variable` says even where a column has the same name (0011).
    IF partitioned THEN
        -- A row trigger, cloned onto every partition (statement triggers with transition
        -- tables are not).
        template := $body$#variable_conflict use_variable
        BEGIN
            -- Generated by sync.track (sql/backend/0012_relay_least_privilege.sql).
            INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
            VALUES (%1$L, %2$L, %4$s, to_json(%5$s));%3$s
            RETURN NULL;
        END;
        $body$;
        new_row := 'NEW';
        old_row := 'OLD';
    ELSE
        template := $body$#variable_conflict use_variable
        BEGIN
            -- Generated by sync.track (sql/backend/0012_relay_least_privilege.sql).
            -- sync_changed_rows: the statement's new rows, or its old ones for a DELETE.
            INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
            SELECT %1$L, %2$L, %4$s, to_json(%5$s.*) FROM sync_changed_rows AS %5$s;
            -- A statement that changed no row wrote nothing and wakes nobody.%3$s
            RETURN NULL;
        END;
        $body$;
        new_row := 'r';
        old_row := 'r';
    END IF;
    -- %1$L the operation, %2$L the entity type, %3$s the wake-up, %4$s the key, %5$s the row.
    wake_up := format(wake_up, CASE WHEN partitioned THEN '' ELSE 'FOUND AND ' END);
    EXECUTE format(
        create_function, relay,
        format(template, 'upsert', entity_type, wake_up,
               sync.relay_key_expression(target, key_column, new_row), new_row)
    );
    EXECUTE format(
        create_function, relay_delete,
        format(template, 'delete', entity_type, wake_up,
               sync.relay_key_expression(target, key_column, old_row), old_row)
    );
    body := format(
        $body$#variable_conflict use_variable
        DECLARE
            key_taken boolean;
        BEGIN
            -- Generated by sync.track (sql/backend/0012_relay_least_privilege.sql). Runs only
            -- when a key changed, so the lookup may be planned on every call. The table is
            -- named from its oid when the lookup runs, so a renamed table is still found; a
            -- partitioned one is read through its parent, whose rows hold the key. A
            -- RESTRICTIVE policy added since sync.track would hide rows from the check (a key
            -- taken would go unseen, and a live entity be deleted downstream) and run its
            -- code as this role: the key change is refused instead, before the policy is read.
            IF pg_catalog.row_security_active(%4$L::oid) AND EXISTS (
                SELECT 1 FROM pg_catalog.pg_policy p
                 WHERE p.polrelid = %4$L::oid AND NOT p.polpermissive
                   AND p.polcmd IN ('r', '*')
                   AND (0::oid OPERATOR(pg_catalog.=) ANY (p.polroles)
                        OR EXISTS (SELECT 1 FROM pg_catalog.unnest(p.polroles) AS r(oid)
                                    WHERE pg_catalog.pg_has_role(r.oid, 'MEMBER')))
            ) THEN
                RAISE EXCEPTION 'serversync: the key of a row of %% changed, and the table has a '
                                'RESTRICTIVE policy, which hides rows from the relay''s check '
                                'that no other row took the old key', %4$L::oid::regclass
                    USING ERRCODE = 'insufficient_privilege',
                          HINT = 'Drop the policy, or make it PERMISSIVE, then run sync.track '
                                 'on the table again.';
            END IF;
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM %%s AS t WHERE t.%%I %%s $1)',
                           %4$L::oid::regclass, %1$L, %3$L)
                INTO key_taken USING OLD.%1$I;
            IF key_taken THEN
                RETURN NULL;  -- another row took the old key in the same statement
            END IF;
            INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
            VALUES ('delete', %2$L, %5$s, to_json(OLD));
            RETURN NULL;
        END;
        $body$,
        key_column, entity_type, key_equals, target::oid,
        sync.relay_key_expression(target, key_column, 'OLD')
    );
    EXECUTE format(create_function, rekey, body);
    -- No one calls them but their triggers: CREATE TRIGGER needs EXECUTE on the function, a
    -- trigger that fires does not.
    EXECUTE format('REVOKE ALL ON FUNCTION %s(), %s(), %s() FROM PUBLIC',
                   relay, relay_delete, rekey);
    -- Every relay trigger carries (entity type, key column): sync.tracked_tables reads them.
    IF partitioned THEN
        EXECUTE format(
            'CREATE TRIGGER sync_relay AFTER INSERT OR UPDATE ON %s '
            'FOR EACH ROW EXECUTE FUNCTION %s(%L, %L)',
            qualified, relay, entity_type, key_column
        );
        EXECUTE format(
            'CREATE TRIGGER sync_relay_delete AFTER DELETE ON %s '
            'FOR EACH ROW EXECUTE FUNCTION %s(%L, %L)',
            qualified, relay_delete, entity_type, key_column
        );
    ELSE
        EXECUTE format(
            'CREATE TRIGGER sync_relay AFTER INSERT ON %s '
            'REFERENCING NEW TABLE AS sync_changed_rows '
            'FOR EACH STATEMENT EXECUTE FUNCTION %s(%L, %L)',
            qualified, relay, entity_type, key_column
        );
        EXECUTE format(
            'CREATE TRIGGER sync_relay_update AFTER UPDATE ON %s '
            'REFERENCING NEW TABLE AS sync_changed_rows '
            'FOR EACH STATEMENT EXECUTE FUNCTION %s(%L, %L)',
            qualified, relay, entity_type, key_column
        );
        EXECUTE format(
            'CREATE TRIGGER sync_relay_delete AFTER DELETE ON %s '
            'REFERENCING OLD TABLE AS sync_changed_rows '
            'FOR EACH STATEMENT EXECUTE FUNCTION %s(%L, %L)',
            qualified, relay_delete, entity_type, key_column
        );
    END IF;
    -- UPDATE OF the key column: an UPDATE that does not name the key skips the trigger before
    -- its WHEN clause is read back from its stored form and planned (~14k instructions in
    -- every such statement). A BEFORE UPDATE row trigger could change the key without the
    -- UPDATE naming it, so a table that has one keeps the trigger on every UPDATE (one added
    -- later needs sync.track again, as a renamed key column does). In a trigger's WHEN clause
    -- OLD and NEW are the only relations, and the key is named through them.
    IF EXISTS (
        SELECT 1 FROM pg_trigger
        WHERE tgrelid = target AND NOT tgisinternal
          AND (tgtype::integer & 19) = 19  -- ROW | BEFORE | UPDATE
    ) THEN
        key_named := '';
    ELSE
        key_named := format(' OF %I', key_column);
    END IF;
    EXECUTE format(
        'CREATE TRIGGER sync_rekey AFTER UPDATE%s ON %s FOR EACH ROW '
        'WHEN (OLD.%I IS DISTINCT FROM NEW.%I) EXECUTE FUNCTION %s(%L, %L)',
        key_named, qualified, key_column, key_column, rekey, entity_type, key_column
    );
    IF NOT as_relay THEN
        RETURN;
    END IF;
    -- Hand the functions to serversync_relay. A new owner needs CREATE on the functions' schema
    -- unless a superuser hands them over: lent for these statements, taken back before the
    -- transaction ends, one sync.track at a time (two grants on one schema at once fail).
    lend_create := NOT (SELECT r.rolsuper FROM pg_roles r WHERE r.rolname = current_user)
                   AND NOT has_schema_privilege('serversync_relay', 'sync', 'CREATE')
                   AND EXISTS (SELECT 1 FROM pg_proc p
                                WHERE p.oid IN (to_regprocedure(relay || '()'),
                                                to_regprocedure(relay_delete || '()'),
                                                to_regprocedure(rekey || '()'))
                                  AND p.proowner <> 'serversync_relay'::regrole);
    IF lend_create THEN
        PERFORM pg_advisory_xact_lock(hashtext('sync.track'));
        GRANT CREATE ON SCHEMA sync TO serversync_relay;
    END IF;
    EXECUTE format('ALTER FUNCTION %s() OWNER TO serversync_relay', relay);
    EXECUTE format('ALTER FUNCTION %s() OWNER TO serversync_relay', relay_delete);
    EXECUTE format('ALTER FUNCTION %s() OWNER TO serversync_relay', rekey);
    IF lend_create THEN
        REVOKE CREATE ON SCHEMA sync FROM serversync_relay;
    END IF;
    -- What the rekey check reads: the key column, every row of it whatever row level security
    -- the table has or gets (a policy does nothing while the table has none), the table's
    -- schema and the equality operator's.
    EXECUTE format('REVOKE ALL ON TABLE %s FROM serversync_relay', qualified);
    EXECUTE format('GRANT SELECT (%I) ON TABLE %s TO serversync_relay', key_column, qualified);
    IF EXISTS (SELECT 1 FROM pg_policy
                WHERE polrelid = target AND polname = 'sync_relay_rekey') THEN
        EXECUTE format('DROP POLICY sync_relay_rekey ON %s', qualified);
    END IF;
    EXECUTE format(
        'CREATE POLICY sync_relay_rekey ON %s AS PERMISSIVE FOR SELECT TO serversync_relay '
        'USING (true)', qualified
    );
    FOREACH needed_schema IN ARRAY ARRAY[table_schema, equals_schema] LOOP
        IF NOT has_schema_privilege('serversync_relay', needed_schema, 'USAGE') THEN
            EXECUTE format('GRANT USAGE ON SCHEMA %I TO serversync_relay', needed_schema);
        END IF;
        IF NOT has_schema_privilege('serversync_relay', needed_schema, 'USAGE') THEN
            RAISE EXCEPTION 'sync.track: the relay of % needs USAGE on schema %, which % may '
                            'not grant', target, quote_ident(needed_schema), current_user
                USING ERRCODE = 'insufficient_privilege',
                      HINT = format('GRANT USAGE ON SCHEMA %I TO serversync_relay, then track '
                                    'the table again.', needed_schema);
        END IF;
    END LOOP;
END;
$$;

CREATE OR REPLACE FUNCTION sync.untrack(target regclass) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    qualified text;
BEGIN
    PERFORM sync.drop_relay_triggers(target);
    EXECUTE format('DROP FUNCTION IF EXISTS sync.%I()', 'relay_' || target::oid);
    EXECUTE format('DROP FUNCTION IF EXISTS sync.%I()', 'relay_delete_' || target::oid);
    EXECUTE format('DROP FUNCTION IF EXISTS sync.%I()', 'rekey_' || target::oid);
    SELECT format('%I.%I', n.nspname, c.relname) INTO qualified
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = target;
    IF EXISTS (SELECT 1 FROM pg_policy
                WHERE polrelid = target AND polname = 'sync_relay_rekey') THEN
        EXECUTE format('DROP POLICY sync_relay_rekey ON %s', qualified);
    END IF;
    IF to_regrole('serversync_relay') IS NOT NULL THEN
        EXECUTE format('REVOKE ALL ON TABLE %s FROM serversync_relay', qualified);
    END IF;
END;
$$;

REVOKE EXECUTE ON FUNCTION sync.track(regclass, text, text), sync.untrack(regclass),
    sync.relay_refusal(regclass, text) FROM PUBLIC;

-- Regenerate the relay of every tracked table. One that sync.track now refuses loses its relay,
-- with a WARNING, rather than failing the whole upgrade: its old functions ran as the writer,
-- which may no longer write the outbox, and must not stay.
DO $regenerate$
DECLARE
    tracked record;
    refusal text[];
BEGIN
    FOR tracked IN SELECT table_name, entity_type, key_column FROM sync.tracked_tables LOOP
        refusal := sync.relay_refusal(tracked.table_name, tracked.key_column);
        IF refusal IS NULL THEN
            PERFORM sync.track(tracked.table_name, tracked.entity_type, tracked.key_column);
        ELSE
            PERFORM sync.untrack(tracked.table_name);
            RAISE WARNING 'serversync: table % is no longer tracked (entity type %): its changes '
                          'are NOT relayed from now on, and its relay was removed. %',
                          tracked.table_name, quote_literal(tracked.entity_type), refusal[1]
                USING HINT = refusal[2] || format(' Then: SELECT sync.track(%L, %L, %L);',
                                                  tracked.table_name::text,
                                                  tracked.entity_type, tracked.key_column);
        END IF;
    END LOOP;
END
$regenerate$;
