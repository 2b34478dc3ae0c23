"""The named queries of sql/queries.sql, as the store loads them."""

from __future__ import annotations

from psycopg import _queries as psycopg_queries

from consumer.store.queries import _queries, parse_named_queries


def test_a_query_s_leading_comment_block_is_left_out_and_the_statement_kept_whole() -> None:
    text = (
        "-- name: first\n"
        "-- What it does, for readers.\n"
        "--   and why, over two lines.\n"
        "SELECT 1 -- an inline comment stays\n"
        "FROM t\n"
        "-- a comment inside the statement stays too\n"
        "WHERE x = '--not a comment';\n"
        "\n"
        "-- name: second\n"
        "SELECT 2;\n"
    )
    assert parse_named_queries(text) == {
        "first": "SELECT 1 -- an inline comment stays\nFROM t\n"
        "-- a comment inside the statement stays too\nWHERE x = '--not a comment';",
        "second": "SELECT 2;",
    }


def test_every_named_query_is_short_enough_for_psycopg_to_cache_its_conversion() -> None:
    """psycopg converts a statement of over MAX_CACHED_STATEMENT_LENGTH bytes afresh (a regex
    over its whole text) at every execution: for the gap-safe read, run many times a second,
    that was 13 us of client CPU a read instead of 2."""
    limit = psycopg_queries.MAX_CACHED_STATEMENT_LENGTH
    too_long = {
        name: len(text.encode()) for name, text in _queries().items() if len(text.encode()) > limit
    }
    assert not too_long, f"over psycopg's {limit}-byte cache limit: {too_long}"
