// A small typed client of Orchard's environment service (orchard.env.v1.EnvService).
//
// The service definitions are loaded at run time from the .proto files shipped in this package
// (copied from the repository's protos/ at build time); the TypeScript types are generated from
// the same files by proto-loader-gen-types, with the same loader options as LOADER_OPTIONS.
import * as path from "node:path";
import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";
import * as protobuf from "protobufjs";

import type { ProtoGrpcType } from "./generated/env_service";
import type { EnvServiceClient } from "./generated/orchard/env/v1/EnvService";
import type { Sandbox__Output } from "./generated/orchard/env/v1/Sandbox";
import type { SandboxSpec } from "./generated/orchard/env/v1/SandboxSpec";
import type { WriteFileResponse__Output } from "./generated/orchard/env/v1/WriteFileResponse";
import type { Command } from "./generated/orchard/types/v1/Command";
import type { ExecResult__Output } from "./generated/orchard/types/v1/ExecResult";

export type { Sandbox__Output as Sandbox, SandboxSpec, Command, ExecResult__Output as ExecResult };
export type { WriteFileResponse__Output as WriteFileResponse };

/** Where the shipped .proto files are: `proto/` at the package root. */
export const PROTO_DIR = path.resolve(__dirname, "..", "proto");

/** Long integers as strings, enums as their names, defaults filled in, oneof names set. */
const LOADER_OPTIONS: protoLoader.Options = {
  keepCase: false,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
  includeDirs: [PROTO_DIR],
};

/** Bytes per WriteFile chunk; well below gRPC's default 4 MiB message limit. */
const CHUNK_BYTES = 1 << 20;

/** The `ErrorInfo.domain` every Orchard service sets. */
export const ORCHARD_DOMAIN = "orchard";

/**
 * A failed call: the gRPC status plus the `google.rpc.ErrorInfo` the service attached in
 * `grpc-status-details-bin` (reason such as `SANDBOX_NOT_FOUND`, domain, metadata).
 */
export class OrchardError extends Error {
  readonly code: grpc.status;
  readonly codeName: string;
  /** The ErrorInfo reason, or the status code's name when the service attached none. */
  readonly reason: string;
  readonly domain: string;
  readonly metadata: Record<string, string>;
  readonly method: string;

  constructor(method: string, error: grpc.ServiceError) {
    const codeName = grpc.status[error.code] ?? String(error.code);
    super(`${method}: ${codeName}: ${error.details}`);
    this.name = "OrchardError";
    this.method = method;
    this.code = error.code;
    this.codeName = codeName;
    const info = decodeErrorInfo(error.metadata);
    this.reason = info?.reason || codeName;
    this.domain = info?.domain ?? "";
    this.metadata = info?.metadata ?? {};
  }
}

export interface ErrorInfo {
  reason: string;
  domain: string;
  metadata: Record<string, string>;
}

let richStatusRoot: protobuf.Root | undefined;

/** google.rpc.Status and ErrorInfo from the shipped google/rpc protos, loaded once. */
function richStatusTypes(): { status: protobuf.Type; errorInfo: protobuf.Type } {
  if (richStatusRoot === undefined) {
    const root = new protobuf.Root();
    root.resolvePath = (_origin, target) => path.join(PROTO_DIR, target);
    root.loadSync(["google/rpc/status.proto", "google/rpc/error_details.proto"]);
    richStatusRoot = root;
  }
  return {
    status: richStatusRoot.lookupType("google.rpc.Status"),
    errorInfo: richStatusRoot.lookupType("google.rpc.ErrorInfo"),
  };
}

/** The ErrorInfo in a failed call's `grpc-status-details-bin` trailer, or undefined. */
export function decodeErrorInfo(trailers: grpc.Metadata | undefined): ErrorInfo | undefined {
  const raw = trailers?.get("grpc-status-details-bin")[0];
  if (raw === undefined || typeof raw === "string") {
    return undefined;
  }
  const types = richStatusTypes();
  const status = types.status.toObject(types.status.decode(raw), { defaults: true }) as {
    details: { type_url: string; value: Uint8Array }[];
  };
  for (const detail of status.details) {
    if (detail.type_url.endsWith("/google.rpc.ErrorInfo")) {
      const info = types.errorInfo.toObject(types.errorInfo.decode(detail.value), {
        defaults: true,
      });
      return { reason: info.reason, domain: info.domain, metadata: { ...info.metadata } };
    }
  }
  return undefined;
}

export interface ClientOptions {
  /** Bearer token sent as `authorization: Bearer <token>` on every call; none when omitted. */
  token?: string;
  /** Channel credentials; plaintext when omitted (use grpc.credentials.createSsl() for TLS). */
  credentials?: grpc.ChannelCredentials;
  /** Deadline of each unary call in seconds (default 120). */
  callTimeoutSeconds?: number;
}

/** Loads the service definition from the shipped protos. */
export function loadEnvService(): ProtoGrpcType {
  const definition = protoLoader.loadSync("orchard/env/v1/env_service.proto", LOADER_OPTIONS);
  return grpc.loadPackageDefinition(definition) as unknown as ProtoGrpcType;
}

/** create, wait, exec, upload, download and delete sandboxes through orchard-env. */
export class SandboxClient {
  readonly stub: EnvServiceClient;
  private readonly token?: string;
  private readonly callTimeoutSeconds: number;

  constructor(endpoint: string, options: ClientOptions = {}) {
    const { orchard } = loadEnvService();
    const credentials = options.credentials ?? grpc.credentials.createInsecure();
    this.stub = new orchard.env.v1.EnvService(endpoint, credentials);
    this.token = options.token;
    this.callTimeoutSeconds = options.callTimeoutSeconds ?? 120;
  }

  close(): void {
    this.stub.close();
  }

  /** Creates a sandbox; it starts PENDING (see wait). */
  async create(spec: SandboxSpec, requestId?: string): Promise<Sandbox__Output> {
    const reply = await this.unary("CreateSandbox", { spec, requestId: requestId ?? "" });
    return required(reply.sandbox, "CreateSandbox");
  }

  /** Blocks until the sandbox leaves PENDING or `timeoutSeconds` pass; returns its state. */
  async wait(sandboxId: string, timeoutSeconds = 60): Promise<Sandbox__Output> {
    const reply = await this.unary(
      "WaitSandbox",
      { sandboxId, timeout: { seconds: String(Math.floor(timeoutSeconds)), nanos: 0 } },
      timeoutSeconds + 30,
    );
    return required(reply.sandbox, "WaitSandbox");
  }

  async get(sandboxId: string): Promise<Sandbox__Output> {
    return required((await this.unary("GetSandbox", { sandboxId })).sandbox, "GetSandbox");
  }

  /** Runs a command to completion; a non-zero exit is a result, not an error. */
  async exec(sandboxId: string, command: Command): Promise<ExecResult__Output> {
    return required((await this.unary("Exec", { sandboxId, command })).result, "Exec");
  }

  async delete(sandboxId: string, requestId?: string): Promise<void> {
    await this.unary("DeleteSandbox", { sandboxId, requestId: requestId ?? "" });
  }

  /** Writes `data` to `filePath` in the sandbox: a header message, then chunks (WriteFile). */
  upload(
    sandboxId: string,
    filePath: string,
    data: Uint8Array,
    options: { mode?: number; makeParents?: boolean; noOverwrite?: boolean } = {},
  ): Promise<WriteFileResponse__Output> {
    return new Promise((resolve, reject) => {
      const call = this.stub.WriteFile(this.metadata(), this.callOptions(), (error, reply) =>
        settle("WriteFile", error, reply, resolve, reject),
      );
      call.write({
        header: {
          sandboxId,
          path: filePath,
          mode: options.mode ?? 0,
          makeParents: options.makeParents ?? false,
          noOverwrite: options.noOverwrite ?? false,
        },
      });
      for (let at = 0; at < data.length; at += CHUNK_BYTES) {
        call.write({ data: data.subarray(at, at + CHUNK_BYTES) });
      }
      call.end();
    });
  }

  /** Reads the whole file at `filePath` from the sandbox (ReadFile stream). */
  download(sandboxId: string, filePath: string): Promise<Buffer> {
    return new Promise((resolve, reject) => {
      const chunks: Buffer[] = [];
      const call = this.stub.ReadFile({ sandboxId, path: filePath }, this.metadata(), {
        deadline: this.deadline(),
      });
      call.on("data", (message: { data: Buffer }) => chunks.push(message.data));
      call.on("error", (error: grpc.ServiceError) => reject(new OrchardError("ReadFile", error)));
      call.on("end", () => resolve(Buffer.concat(chunks)));
    });
  }

  private metadata(): grpc.Metadata {
    const metadata = new grpc.Metadata();
    if (this.token) {
      metadata.set("authorization", `Bearer ${this.token}`);
    }
    return metadata;
  }

  private deadline(seconds = this.callTimeoutSeconds): Date {
    return new Date(Date.now() + seconds * 1000);
  }

  private callOptions(seconds?: number): grpc.CallOptions {
    return { deadline: this.deadline(seconds) };
  }

  /** One unary call with the token and a deadline; failures become OrchardError. */
  private unary<M extends UnaryMethod>(
    method: M,
    request: Parameters<EnvServiceClient[M]>[0],
    timeoutSeconds?: number,
  ): Promise<UnaryReply<M>> {
    return new Promise((resolve, reject) => {
      const call = this.stub[method].bind(this.stub) as unknown as (
        request: unknown,
        metadata: grpc.Metadata,
        options: grpc.CallOptions,
        callback: (error: grpc.ServiceError | null, reply?: UnaryReply<M>) => void,
      ) => grpc.ClientUnaryCall;
      call(request, this.metadata(), this.callOptions(timeoutSeconds), (error, reply) =>
        settle(method, error, reply, resolve, reject),
      );
    });
  }
}

type UnaryMethod = "CreateSandbox" | "WaitSandbox" | "GetSandbox" | "Exec" | "DeleteSandbox";

/** The reply type a unary method hands its callback. */
type UnaryReply<M extends UnaryMethod> =
  Parameters<EnvServiceClient[M]>[1] extends grpc.requestCallback<infer R> ? R : never;

function settle<R>(
  method: string,
  error: grpc.ServiceError | null,
  reply: R | undefined,
  resolve: (value: R) => void,
  reject: (reason: OrchardError) => void,
): void {
  if (error) {
    reject(new OrchardError(method, error));
  } else {
    resolve(required(reply, method));
  }
}

function required<T>(value: T | null | undefined, method: string): T {
  if (value === null || value === undefined) {
    throw new Error(`${method}: the reply has no payload`);
  }
  return value;
}
