"""The operator's one-shot commands: topics, API keys, the key-encryption key, usage,
replay, audit, erasure and rollouts (``pipeline --help`` says each).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from pipeline.settings import CommonSettings
from schemas.rollout import HealthPolicy


def run_rollout_command(common: CommonSettings, args: argparse.Namespace) -> int:
    from launch.rollout import Controller, RolloutRefused
    from pipeline.rollout import RolloutBook
    from schemas.rollout import describe

    if args.alias == "status":
        book = RolloutBook(common.kafka_bootstrap)
        try:
            records = book.read_to_end()
        finally:
            book.close()
        shown = [r for a, r in sorted(records.items())
                 if args.status_alias in (None, a)]
        if not shown:
            print("no rollout yet" + (f" of {args.status_alias}" if args.status_alias
                                      else ""), file=sys.stderr)
            return 1
        for record in shown:
            print(record.model_dump_json() if args.json else describe(record))
        return 0
    if args.status_alias is not None:
        print(f"pipeline rollout: unexpected argument {args.status_alias!r}", file=sys.stderr)
        return 2
    for name in (args.alias, args.to or "x"):
        if not 0 < len(name) <= 200 or not name.isprintable():
            print(f"pipeline rollout: a model name is 1 to 200 printable characters: "
                  f"{name[:40]!r}", file=sys.stderr)
            return 2
    controller = Controller(common.kafka_bootstrap)
    policy = HealthPolicy(args.turns, args.max_failure_increase, args.max_ttft_ratio,
                          args.ttft_slack_ms, args.timeout)
    try:
        if args.abort:
            controller.abort(args.alias)
            return 0
        if not args.to:
            print("pipeline rollout: name the version: --to VERSION", file=sys.stderr)
            return 2
        record = controller.start(args.alias, args.to, args.share, policy)
    except RolloutRefused as exc:
        print(f"pipeline rollout: {exc}", file=sys.stderr)
        return 2
    return 0 if controller.watch(record, policy).status == "promoted" else 1


def run_topics_command(common: CommonSettings, fix: bool = False) -> int:
    """The topics an operator's cluster needs, made with the topic settings
    (``PIPELINE_PARTITIONS``, ``PIPELINE_REPLICATION_FACTOR``, ...). Existing ones are
    kept, their record limit raised to the pipeline's, and their other settings checked
    (``pipeline.topicconfig``): what differs is shown, and set with ``fix`` where that
    keeps at least as much. 1 if a setting left would make the services refuse to start."""
    from pipeline.kafka import broker_count, ensure_topics, set_topic_configs, topic_configs
    from pipeline.topicconfig import ADVICE, BY_HAND, drift, fixable, hazards, warnings
    from pipeline.topics import topic_specs

    specs = topic_specs(common.topic_policy(), broker_count(common.kafka_bootstrap))
    created = ensure_topics(common.kafka_bootstrap, specs)
    kept = [s.name for s in specs if s.name not in created]
    configs = topic_configs(common.kafka_bootstrap, kept) if kept else {}
    differs = drift(specs, configs)
    if fix and (changes := [f for f in differs if fixable(f)]):
        settings: dict[str, dict[str, str]] = {}
        for finding in changes:
            settings.setdefault(finding.topic, {})[finding.setting] = finding.want
        set_topic_configs(common.kafka_bootstrap, settings)
        configs = topic_configs(common.kafka_bootstrap, kept)
        differs = drift(specs, configs)
    for spec in specs:
        if spec.name in created:
            print(f"{spec.name:<20} created ({spec.partitions} partitions, replication "
                  f"{spec.replication}, {spec.config.get('min.insync.replicas')} in sync)")
            continue
        own = [f for f in differs if f.topic == spec.name]
        print(f"{spec.name:<20} exists" + (", as the pipeline makes it" if not own else ""))
        for finding in own:
            print(f"  {finding.setting}={finding.have} (the pipeline's: {finding.want})"
                  + ("; --fix sets it" if fixable(finding) else
                     "; left as it is: it must not pass the topic's in-sync replicas"
                     if finding.setting in BY_HAND else
                     "; left as it is: the pipeline's keeps less, and lowering it deletes "
                     "records"))
    for warning in warnings(common.kafka_bootstrap, configs, common.topic_policy()):
        print(f"pipeline topics: warning: {warning}", file=sys.stderr)
    refused = hazards(configs, common.topic_policy())
    for finding in refused:
        print(f"pipeline topics: services refuse to start: {finding}", file=sys.stderr)
    if refused and not fix:
        print(f"pipeline topics: {ADVICE}", file=sys.stderr)
    return 1 if refused else 0


def run_keys_command(common: CommonSettings, args: argparse.Namespace) -> int:
    import psycopg

    from gateway import keys
    from projections.migrate import migrate

    migrate(common.database_url)
    with psycopg.connect(common.database_url, autocommit=True) as conn:
        if args.keys == "create":
            secret, key = keys.create(conn, args.tenant, args.name, args.rpm, args.tpm)
            print(secret)
            print(f"key {key.id} for tenant '{key.tenant}' (rpm {key.rpm or 'unlimited'}, "
                  f"tpm {key.tpm or 'unlimited'}). It is shown only now: store it safely.",
                  file=sys.stderr)
        elif args.keys == "list":
            for key in keys.listed(conn):
                if args.json:
                    print(json.dumps(key.to_json()))
                else:
                    state = f"revoked {key.revoked_at:%Y-%m-%d %H:%M}" if key.revoked_at \
                        else "active"
                    print(f"{key.id}  {key.tenant:<20} {key.name or '-':<20} "
                          f"rpm {key.rpm or '-':<8} tpm {key.tpm or '-':<10} {state}")
        else:
            return _revoke(common, conn, args.key_id)
    return 0


def _revoke(common: CommonSettings, conn: Any, key_id: str) -> int:
    """Revoke a key, and stop its turns still running, background ones included (again
    for a key revoked before), once now and once after the gateways' 2 s cache of it
    (turns accepted meanwhile, or that the store had not shown yet)."""
    from gateway import keys

    if keys.revoke(conn, key_id):
        print(f"revoked {key_id}; gateways refuse it within 2 s", flush=True)
    elif not any(k.id == key_id for k in keys.listed(conn)):
        print(f"no key {key_id}", file=sys.stderr)
        return 1
    else:
        print(f"{key_id} was revoked already", flush=True)
    for sweep in (0, 1):
        if sweep:
            time.sleep(3.0)
        stopped = keys.stop_turns(conn, common.kafka_bootstrap, key_id)
        if stopped:
            print(f"stopped {stopped} of its turns", flush=True)
    return 0


def run_replay_command(common: CommonSettings, args: argparse.Namespace) -> int:
    from pipeline.keystore import open_keyring
    from projections.replay import ReplayError, run_replay

    url = args.target_url or common.database_url
    if not args.target_url and not args.schema:
        raise SystemExit("replay needs a target: --schema NAME or --target-url URL "
                         "(the live store is never overwritten)")
    try:
        with open_keyring(common, "replay", read_ahead=True, reading=True) as keyring:
            stats = run_replay(common.kafka_bootstrap, url, keyring.codec, args.schema,
                               args.until)
    except (ReplayError, ValueError) as exc:
        print(f"replay refused: {exc}", file=sys.stderr)
        return 2
    print(f"replayed {stats.records} records in {stats.seconds:.1f}s "
          f"({stats.rate:,.0f} events/s): {stats.applied} applied, "
          f"{stats.skipped_after_until} after --until, {stats.undecodable} undecodable")
    return 0


def run_usage_command(common: CommonSettings, args: argparse.Namespace) -> int:
    import psycopg

    from gateway.usage_query import UsageError, UsageQuery, format_table, usage
    from projections.migrate import in_schema

    end = args.end or datetime.now(UTC)
    try:
        query = UsageQuery.build(args.tenant, args.start and int(args.start.timestamp()),
                                 int(end.timestamp()), args.bucket_width, args.group_by)
    except UsageError as exc:
        print(f"pipeline usage: {exc}", file=sys.stderr)
        return 2
    with psycopg.connect(in_schema(common.database_url, args.schema)) as conn:
        page = usage(conn, query)
    print(json.dumps(page, indent=2) if args.json else format_table(page, query))
    return 0


def run_kek_command(common: CommonSettings, args: argparse.Namespace) -> int:
    from launch.rotate import RotationError, rotate_command

    try:
        return rotate_command(common, args)
    except RotationError as exc:
        print(f"pipeline kek rotate: {exc}", file=sys.stderr)
        return 1


def run_erase_command(common: CommonSettings, args: argparse.Namespace) -> int:
    from launch.erase import erase_command

    return erase_command(common, args)


def run_audit_command(common: CommonSettings, args: argparse.Namespace) -> int:
    from pipeline.keystore import open_keyring
    from projections.audit import audit, format_text

    since = args.since or (None if args.from_beginning else _created(common, args.session_id))
    with open_keyring(common, "audit", reading=True) as keyring:
        if since is None and not args.from_beginning:
            print("the store does not know when this session began: reading its "
                  "partitions from their start (--since bounds the read)", file=sys.stderr)
        entries, live = audit(common.kafka_bootstrap, keyring.codec, args.session_id,
                              None if since is None else int(since.timestamp() * 1000))
    if not entries:
        print(f"no events for session {args.session_id}", file=sys.stderr)
        return 1
    if args.json:
        for line in [e.to_json() for e in entries] + [e.to_json() for e in live]:
            print(json.dumps(line, ensure_ascii=False))
    else:
        print(format_text(entries, live, deltas=args.deltas))
    return 0


def _created(common: CommonSettings, conversation: uuid.UUID) -> datetime | None:
    """When the store says the conversation began (its first event, or its first key);
    None if it does not know, or does not answer."""
    import psycopg

    try:
        with psycopg.connect(common.database_url, connect_timeout=5) as conn:
            row = conn.execute(
                "SELECT least((SELECT created_at FROM conversations WHERE id = %(c)s),"
                " (SELECT min(created_at) FROM data_keys WHERE conversation_id = %(c)s))",
                {"c": conversation}).fetchone()
    except psycopg.Error:
        return None
    return row[0] if row else None
