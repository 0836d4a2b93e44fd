"""A batch's steps that one gateway does alone, under the batch's lock: validating the input
file into lines, and finalising (error lines for what never ran, the output and error files,
the final status)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from typing import Any

import orjson

from gateway.batch.files import FileStore
from gateway.batch.lines import (
    InputFileError,
    Parsed,
    Planned,
    error_line,
    file_error,
    parse_input,
    run_order,
)
from gateway.batch.store import BatchStore, now_s

log = logging.getLogger("prefix_gateway.batch")

ENDINGS = {
    "expired": ("batch_expired", "This request could not be executed before the completion "
                "window expired."),
    "cancelled": ("batch_cancelled", "This request was not executed: the batch was "
                  "cancelled."),
}


def output_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's output or error file: fixed, so that finalising twice (a gateway
    that died half-way, then another) writes the same file rather than a second one."""
    return f"file-{kind}-{batch_id.removeprefix('batch_')}"


async def validate(store: BatchStore, files: FileStore, batch: dict[str, str],
                   models: Collection[str], max_lines: int, group_chars: int) -> None:
    """Turn the input file into lines to run (in_progress), or fail the batch."""
    batch_id = batch["id"]
    data = await files.content(batch["input_file_id"])
    try:
        if data is None:
            raise InputFileError([file_error(
                "file_not_found", f"The input file {batch['input_file_id']} was deleted "
                "before the batch was validated.", param="input_file_id")])
        # Off the event loop: a large file takes a while to read, and requests are waiting.
        parsed, plan, lines = await asyncio.to_thread(_plan, data, batch["endpoint"], models,
                                                      max_lines, group_chars)
    except InputFileError as exc:
        failed = await store.transition(
            batch_id, ["validating"], status="failed", failed_at=now_s(),
            errors=orjson.dumps({"object": "list", "data": exc.errors}).decode())
        if failed:
            log.info("batch %s failed validation: %s", batch_id, exc)
            await store.retire(batch_id)
        return
    served = {p.request.model for p in plan}
    fields = {"status": "in_progress", "in_progress_at": str(now_s()),
              "total": str(parsed.total), "failed": str(len(parsed.errors)),
              "model": served.pop() if len(served) == 1 else ""}
    if await store.start_lines(batch_id, lines, [p.request.index for p in plan],
                               parsed.errors, fields):
        log.info("batch %s in progress: %d lines to run in %d prefix groups, %d malformed",
                 batch_id, len(plan), len({p.group for p in plan}), len(parsed.errors))


def _plan(data: bytes, endpoint: str, models: Collection[str], max_lines: int,
          group_chars: int) -> tuple[Parsed, list[Planned], list[tuple[int, bytes]]]:
    """The file read, its lines in run order, and each as stored for the runner."""
    parsed = parse_input(data, endpoint, models, max_lines)
    plan = run_order(parsed.requests, group_chars)
    lines = [(p.request.index, orjson.dumps({"c": p.request.custom_id, "b": p.request.body,
                                             "g": p.group, "l": int(p.leader)}))
             for p in plan]
    return parsed, plan, lines


async def finalize(store: BatchStore, files: FileStore, batch: dict[str, str], kind: str) -> None:
    """Write the files and the final status `kind` (completed, expired or cancelled). Lines
    without a result get an error line saying why they never ran."""
    batch_id = batch["id"]
    total = int(batch.get("total") or 0)
    if kind in ENDINGS:
        code, message = ENDINGS[kind]
        missing = await store.missing(batch_id, total)
        reqs = await store.requests(batch_id, missing)
        await store.fill(batch_id, {i: error_line(r["c"] if r else None, code, message)
                                    for i, r in zip(missing, reqs, strict=True)})
    out, err = await store.results(batch_id, total)
    fields: dict[str, Any] = {"status": kind, f"{kind}_at": now_s()}
    for lines, name in ((out, "output"), (err, "error")):
        if lines:
            file_id = output_file_id(batch_id, name)
            await files.create(b"\n".join(lines) + b"\n", f"{batch_id}_{name}.jsonl",
                               "batch_output", file_id=file_id, owner=batch.get("owner", ""))
            fields[f"{name}_file_id"] = file_id
    if await store.finish(batch_id, {k: str(v) for k, v in fields.items()}):
        log.info("batch %s %s: %d output lines, %d error lines", batch_id, kind, len(out),
                 len(err))
