"""Benchmarks for radixserve: workloads with prefix sharing, offline/online runners, reports.

``radixserve bench`` is :func:`radixserve.bench.cli.main`; see ``benchmarks/README.md``.
"""
