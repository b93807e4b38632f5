# The three gaps binaries on a small runtime base, run as a non-root user.
#   docker build -t gaps:latest .
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin gaps --bin gaps-server --bin gaps-worker

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --create-home --shell /usr/sbin/nologin gaps
COPY --from=build /src/target/release/gaps /src/target/release/gaps-server /src/target/release/gaps-worker /usr/local/bin/
USER 10001
# QUIC (UDP) and metrics/health (TCP).
EXPOSE 7070/udp 9100/tcp
ENTRYPOINT []
CMD ["gaps", "--help"]
