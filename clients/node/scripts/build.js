// Builds the package: copies the shipped protos/ into proto/ (loaded at run time), generates
// TypeScript types for them with proto-loader-gen-types, and compiles src/ into dist/.
"use strict";
const { execFileSync } = require("node:child_process");
const fs = require("node:fs");
const path = require("node:path");

const here = path.resolve(__dirname, "..");
const protos = path.resolve(here, "..", "..", "protos");
const proto = path.join(here, "proto");
const generated = path.join(here, "src", "generated");
const bin = (name) => path.join(here, "node_modules", ".bin", name);

// The same loader options as src/index.ts passes to @grpc/proto-loader, so the types match.
const ENTRY_POINTS = ["orchard/env/v1/env_service.proto", "google/rpc/error_details.proto", "google/rpc/status.proto"];

fs.rmSync(proto, { recursive: true, force: true });
for (const top of ["orchard", "google"]) {
  fs.cpSync(path.join(protos, top), path.join(proto, top), { recursive: true });
}
fs.rmSync(generated, { recursive: true, force: true });
execFileSync(
  bin("proto-loader-gen-types"),
  ["--longs=String", "--enums=String", "--defaults", "--oneofs", "--grpcLib=@grpc/grpc-js",
    "--includeDirs=.", `--outDir=${generated}`, ...ENTRY_POINTS],
  { stdio: "inherit", cwd: proto }, // relative paths, so no build machine path lands in the output
);
fs.rmSync(path.join(here, "dist"), { recursive: true, force: true });
execFileSync(bin("tsc"), ["-p", here], { stdio: "inherit" });
