"""`python -m megabuf.bench` (also `make bench`, `megabuf bench`): megabuf against its peers.

Launches the data-parallel ranks itself (default 2, gloo on CPU), builds each model with the same
seed and data in every system, checks each system's params after one step against a
single-process step on the global batch, then times warm steps and prints a table (median step
time, ratio to torch DDP with gradient_as_bucket_view=True, samples/s, peak RSS per rank,
optimizer-state bytes per rank, ring bytes per step, exposed communication) and writes JSON
lines. See BENCHMARKS.md for a run on the reference machine and what the numbers mean.

Modules: `options` (command line, models, optimizer settings), `reference` (the single-process
step), `systems` (how each peer is built and stepped), `worker` (what a rank runs), `report`
(progress bar, table, JSON lines), `plot` (PNG timeline), `main` (the launcher).
"""
