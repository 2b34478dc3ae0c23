-- The relay's parts that sync.track (functions/track.sql) builds on: what the generated code
-- calls, how it reads a key, what tracking refuses, and the view of what is tracked.
--
-- A function file: `serversync migrate` applies it after the versioned migrations, and again
-- whenever its text changes (and then functions/track.sql too, which regenerates every relay
-- from what is defined here). So every statement here may run again on a database that has it:
-- CREATE OR REPLACE only, with the signatures, parameter names and view columns it has; a change
-- that cannot be made so (a dropped parameter, a view column removed) is a versioned migration.
--
-- The rule the relay keeps, in the generated code and in what generates it: a format string is
-- a constant; a user's name goes in as an argument, through %I where it is an identifier and %L
-- where it is a value; a column is always qualified by the row it belongs to (r, NEW, OLD); a
-- table is named as %I.%I of its schema and name, or by its oid, so no search_path decides what
-- it means. Column names such as r, tg_relid, a % or the text \000 in a name are all legal,
-- and all once broke a relay that did not keep it.

-- The refusal of an empty or NULL key, for every generated function: the outbox has no CHECK
-- constraint on it (schema.sql, The outbox, says why). The relay passes TG_RELID, so the
-- message names the table as it is called when the row is refused, schema-qualified whatever
-- the caller's search_path. No SECURITY DEFINER (it reads and writes nothing), and EXECUTE
-- for PUBLIC: calling it only raises.
CREATE OR REPLACE FUNCTION sync.refuse_empty_key(target regclass, key_column text) RETURNS text
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    RAISE EXCEPTION 'sync relay: a row of % has an empty or NULL key (column %)', target, key_column
        USING ERRCODE = 'check_violation';
END;
$$;

-- The key of a row as its JSON text, as an expression of the generated relay: `row_ref` is the
-- row (r, NEW or OLD; never a user's name), `key_column` the key's name. NULL when the table has
-- no such column. The relay refuses an empty or NULL key, but a key of a number, date, time,
-- boolean, enum or uuid type in a NOT NULL column can be neither, and is not checked: the
-- check's function call costs every statement ~10k instructions to set up, whether it is made
-- or not. The text of an integer, a uuid, a text or a varchar is its JSON text, and is taken as
-- it is; a date or timestamp's JSON text is ISO 8601 whatever DateStyle says, so other types go
-- through to_json. The empty-key check is called with its exact argument types, so that no
-- function added to the schema sync with a closer match can stand in for it.
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

REVOKE EXECUTE ON FUNCTION sync.relay_refusal(regclass, text) FROM PUBLIC;

-- The relay's triggers on a table, whichever of them it has (none, when it was never tracked;
-- a partition's clones go with its parent's trigger).
CREATE OR REPLACE FUNCTION sync.drop_relay_triggers(target regclass) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    existing text;
    qualified text;
BEGIN
    SELECT format('%I.%I', n.nspname, c.relname) INTO qualified
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = target;
    FOR existing IN
        SELECT tgname FROM pg_trigger
        WHERE tgrelid = target AND tgparentid = 0
          AND tgname IN ('sync_relay', 'sync_relay_update', 'sync_relay_delete', 'sync_rekey')
    LOOP
        EXECUTE format('DROP TRIGGER %I ON %s', existing, qualified);
    END LOOP;
END;
$$;

-- What is tracked, for operators and for regenerating the relays: table, entity type, key
-- column, and whether the table is tracked both ways, read back from the arguments every relay
-- trigger carries. It cuts the bytes of tgargs at their NUL bytes (no name can hold one) and
-- decodes each part as it is, in the database's encoding, so any legal name comes back as it was
-- given. A partition of a tracked partitioned table holds a clone of its parent's trigger
-- (tgparentid set): the table tracked is the parent.
CREATE OR REPLACE VIEW sync.tracked_tables AS
SELECT t.tgrelid::regclass AS table_name,
       convert_from(substr(t.tgargs, 1, cut.at - 1), getdatabaseencoding()) AS entity_type,
       convert_from(substr(rest.args, 1, position(decode('00', 'hex') IN rest.args) - 1),
                    getdatabaseencoding()) AS key_column,
       t.tgnargs = 3 AS both_ways
FROM pg_trigger t
     -- tgargs: the entity type, NUL, the key column, NUL, and for a table tracked both ways
     -- 'both_ways', NUL.
     CROSS JOIN LATERAL (SELECT position(decode('00', 'hex') IN t.tgargs) AS at) cut
     CROSS JOIN LATERAL (SELECT substr(t.tgargs, cut.at + 1) AS args) rest
WHERE t.tgname = 'sync_relay' AND NOT t.tgisinternal AND t.tgparentid = 0
  AND t.tgnargs IN (2, 3);
