# kvroute: one static binary (serve, epp, sim, bench, ...) in a distroless, non-root image.
#
#   docker build -t kvroute .
#   docker run --rm -p 8000:8000 -v $PWD/examples:/etc/kvroute kvroute serve -c /etc/kvroute/kvroute.yaml
#
# Built on Alpine, so the Rust target is musl and the binary is static (ring's C and assembly
# build with gcc and musl-dev; nothing else native is needed).
#
# Never built: there is no Docker where kvroute is developed and tested. scripts/check-chart.sh
# checks that the chart runs this image's binary with arguments and configurations it accepts.

FROM rust:1.95-alpine AS build
RUN apk add --no-cache musl-dev
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p kvroute \
    && strip target/release/kvroute \
    && cp target/release/kvroute /kvroute

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /kvroute /usr/local/bin/kvroute
# 8000 OpenAI API (serve), 9002 ext_proc + gRPC health (epp), 8090 admin (/metrics, /health),
# as the Helm chart runs them; the user is 65532, the chart's runAsUser.
EXPOSE 8000 9002 8090
USER nonroot:nonroot
ENTRYPOINT ["/usr/local/bin/kvroute"]
CMD ["--help"]
