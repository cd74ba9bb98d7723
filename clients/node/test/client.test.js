// Drives a real orchard-env through the built client (dist/): create, wait, exec, upload,
// download, delete, and the ErrorInfo of refused calls. ORCHARD_ENDPOINT and ORCHARD_TOKEN name
// the service; integration/tests/test_node_client.py starts one and runs this file.
"use strict";
const assert = require("node:assert/strict");
const crypto = require("node:crypto");
const { test } = require("node:test");
const grpc = require("@grpc/grpc-js");

const { SandboxClient, OrchardError, ORCHARD_DOMAIN } = require("../dist/index.js");

function required(name) {
  const value = process.env[name];
  assert.ok(value, `${name} must name the orchard-env to test against`);
  return value;
}

const endpoint = required("ORCHARD_ENDPOINT");
const token = required("ORCHARD_TOKEN");

test("create, wait, exec, upload, download, delete", async () => {
  const client = new SandboxClient(endpoint, { token });
  try {
    const created = await client.create(
      { image: "host", labels: { client: "node" } },
      crypto.randomUUID(),
    );
    assert.match(created.id, /\S/);
    try {
      const ready = await client.wait(created.id, 60);
      assert.equal(ready.state, "SANDBOX_STATE_READY");

      const result = await client.exec(created.id, { shell: "echo hello from node; exit 3" });
      assert.equal(result.stdout.toString(), "hello from node\n");
      assert.equal(result.status.exitCode, 3);
      assert.equal(result.status.termination, "exitCode");

      // Three WriteFile chunks and a tail, so the stream is really chunked.
      const payload = crypto.randomBytes(3 * (1 << 20) + 12345);
      const written = await client.upload(created.id, "/workspace/node/payload.bin", payload, {
        makeParents: true,
      });
      assert.equal(written.sha256, crypto.createHash("sha256").update(payload).digest("hex"));
      assert.equal(Number(written.info.size), payload.length);

      const check = await client.exec(created.id, { argv: ["sha256sum", "/workspace/node/payload.bin"] });
      assert.equal(check.stdout.toString().split(" ")[0], written.sha256);

      const read = await client.download(created.id, "/workspace/node/payload.bin");
      assert.ok(read.equals(payload), "the downloaded bytes differ from the uploaded ones");
    } finally {
      await client.delete(created.id);
    }
    const gone = await client.get(created.id).then(
      () => assert.fail("GetSandbox of a deleted sandbox succeeded"),
      (error) => error,
    );
    assert.ok(gone instanceof OrchardError, String(gone));
    assert.equal(gone.code, grpc.status.NOT_FOUND);
  } finally {
    client.close();
  }
});

test("a refused call carries its ErrorInfo", async () => {
  const client = new SandboxClient(endpoint, { token });
  try {
    const unknown = `sbx-${crypto.randomUUID()}`;
    const error = await client.exec(unknown, { argv: ["true"] }).then(
      () => assert.fail("Exec in an unknown sandbox succeeded"),
      (failure) => failure,
    );
    assert.ok(error instanceof OrchardError, String(error));
    assert.equal(error.code, grpc.status.NOT_FOUND);
    assert.equal(error.reason, "SANDBOX_NOT_FOUND");
    assert.equal(error.domain, ORCHARD_DOMAIN);
    assert.equal(error.metadata.sandbox_id, unknown);

    const missing = await client.download(unknown, "/etc/hostname").then(
      () => assert.fail("ReadFile in an unknown sandbox succeeded"),
      (failure) => failure,
    );
    assert.equal(missing.reason, "SANDBOX_NOT_FOUND", String(missing));
  } finally {
    client.close();
  }
});

test("a call without a token is UNAUTHENTICATED with its reason", async () => {
  const client = new SandboxClient(endpoint);
  try {
    const error = await client.create({ image: "host" }).then(
      () => assert.fail("CreateSandbox without a token succeeded"),
      (failure) => failure,
    );
    assert.ok(error instanceof OrchardError, String(error));
    assert.equal(error.code, grpc.status.UNAUTHENTICATED);
    assert.equal(error.reason, "UNAUTHENTICATED");
    assert.equal(error.domain, ORCHARD_DOMAIN);
    assert.match(error.message, /bearer token/);
  } finally {
    client.close();
  }
});
