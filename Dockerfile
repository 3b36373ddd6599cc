# kvroute: one binary (serve, epp, sim, bench, ...) in a distroless, non-root image.
#
#   docker build -t kvroute .
#   docker run --rm -p 8000:8000 -v $PWD/examples:/etc/kvroute kvroute serve -c /etc/kvroute/kvroute.yaml
#
# Built against glibc, the configuration every benchmark in docs/benchmarks.md measured, on
# Debian 12 so that the binary's glibc matches the runtime image's. glibc's allocator backs
# the heap with transparent huge pages when asked (GLIBC_TUNABLES below; the host's
# /sys/kernel/mm/transparent_hugepage/enabled must say `madvise` or `always`): the KV index's
# random reads then walk fewer page tables, measured at 11–27% more lookups per second and
# 3–14% faster ingest (docs/operations.md). A static musl build reads no such setting, and its
# allocator was never measured under the index.
#
# Never built: there is no Docker where kvroute is developed and tested. scripts/check-chart.sh
# checks that the chart runs this image's binary with arguments and configurations it accepts.

FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
COPY . .
# gcc (in the image) builds the few C and assembly parts (ring, psm).
RUN cargo build --release --locked -p kvroute \
    && strip target/release/kvroute \
    && cp target/release/kvroute /kvroute

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /kvroute /usr/local/bin/kvroute
ENV GLIBC_TUNABLES=glibc.malloc.hugetlb=1
# 8000 OpenAI API (serve), 9002 ext_proc + gRPC health (epp), 8090 admin (/metrics, /health),
# as the Helm chart runs them; the user is 65532, the chart's runAsUser.
EXPOSE 8000 9002 8090
USER nonroot:nonroot
ENTRYPOINT ["/usr/local/bin/kvroute"]
CMD ["--help"]
