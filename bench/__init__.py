"""Load-testing tools: `kvserve bench serve` (any OpenAI-compatible server, bench/serve.py) and
`kvserve bench throughput` (the engine offline, bench/throughput.py), their datasets and workloads, and
random-weight models for hosts without a model hub (bench/models.py).

Imports: bench may import engine and server; server imports bench only inside the CLI's dispatch."""
