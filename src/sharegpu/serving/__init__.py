"""What sharegpu's servers share: certificates (a private CA, serving and client certificates with
the names they will be reached by) and TLS contexts that follow their files and can require a client
certificate (`certs`, `tls`); who may read /metrics and /debug (`access`); /healthz, /readyz and
/metrics for a component that serves nothing else (`health`); HTTP/2 beside HTTP/1.1 (`http2`);
gRPC on unix sockets (`unixgrpc`); Prometheus counters listed at 0 from the start (`counters`).
No Kubernetes API access here: `access` asks the reviewer it is given."""
