"""``epqlab probe PATH``: measure random-read latency and bandwidth of the device under PATH.

PATH is a file to read (a model), or a directory in which a scratch file is created and removed.
Prints the table (latency in µs, aggregate MB/s with MB = 10**6 bytes, IOPS) and a one-line summary.
"""
from __future__ import annotations

from ..paging.probe import DEFAULT_CONCURRENCY, probe_io
from ..studies.probe_report import format_table, summary_line, to_json
from ..results import run_info, save_csv, write_json
from ..units import parse_bytes


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def _size_list(text: str) -> list[int]:
    return [parse_bytes(x) for x in text.replace(",", " ").split()]


def register(sub) -> None:
    p = sub.add_parser("probe", help="measure the storage device: random-read latency and bandwidth vs concurrency",
                       description=__doc__.split("\n\n", 1)[1])
    p.add_argument("path", help="file to read (e.g. a .gguf), or a directory for a scratch file")
    p.add_argument("--sizes", type=_size_list, default=None, metavar="LIST",
                   help="request sizes, e.g. 4KiB,64KiB,1.9MB (default: those plus a GGUF's expert sizes)")
    p.add_argument("--concurrency", "-c", type=_int_list, default=list(DEFAULT_CONCURRENCY), metavar="LIST",
                   help="reader thread counts (default: %(default)s)")
    p.add_argument("--requests", "-n", type=int, default=64, help="reads per thread per cell (default: %(default)s)")
    p.add_argument("--buffered", action="store_true", help="buffered reads instead of O_DIRECT")
    p.add_argument("--keep-cache", action="store_true", help="do not drop the file's page cache before each cell")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scratch-size", default="2GiB", help="scratch file size when PATH is a directory (default: %(default)s)")
    p.add_argument("--csv", default=None, metavar="FILE", help="also write the full table as CSV")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the table, attrs and summary as JSON")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args) -> int:
    df = probe_io(args.path, request_bytes=args.sizes, concurrency=args.concurrency, n_requests=args.requests,
                  direct=not args.buffered, drop_cache=not args.keep_cache, seed=args.seed,
                  scratch_bytes=args.scratch_size, progress=not args.quiet)
    print(f"{df.attrs['path']}  ({df.attrs['file_size']} bytes{', scratch' if df.attrs['scratch'] else ''})")
    print(format_table(df))
    print()
    print(summary_line(df))
    if args.csv:
        save_csv(df, args.csv)
    if args.json:
        write_json({**to_json(df), "run": run_info(args.path)}, args.json)
    return 0
