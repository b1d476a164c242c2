// Stream one greedy generation from a tokenmill scheduler and print each event as a JSON line.
//
//   node client.js HOST:PORT PROMPT [MAX_TOKENS]
//
// Lines: {"event":"started",...}, then {"event":"delta",...} per Delta, then
// {"event":"finished",...}; a failed call prints {"event":"error","code":...} and exits 1.
// The .proto files are loaded at run time (no generated code), from TOKENMILL_PROTO_ROOT or
// the repository's protos/ folder.
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = process.env.TOKENMILL_PROTO_ROOT || path.resolve(__dirname, "..", "..", "..", "protos");

function loadGenerationService() {
  const definition = protoLoader.loadSync("tokenmill/v1/generation.proto", {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // field names as in the .proto (prompt_tokens, not promptTokens)
    longs: String,
    enums: String, // finish_reason as "FINISH_REASON_LENGTH"
    defaults: true,
    oneofs: true, // each message says which `event` it carries
  });
  return grpc.loadPackageDefinition(definition).tokenmill.v1.Generation;
}

function main(argv) {
  if (argv.length < 2) {
    process.stderr.write("usage: node client.js HOST:PORT PROMPT [MAX_TOKENS]\n");
    return 2;
  }
  const [address, prompt, maxTokens = "32"] = argv;
  const Generation = loadGenerationService();
  const client = new Generation(address, grpc.credentials.createInsecure());
  const request = {
    text: prompt,
    sampling: { temperature: 0.0 },
    stop: { max_tokens: Number(maxTokens) },
  };
  const deadline = new Date(Date.now() + 60_000);
  const call = client.Generate(request, { deadline });
  const print = (event) => process.stdout.write(JSON.stringify(event) + "\n");

  call.on("data", (message) => {
    if (message.event === "started") {
      print({ event: "started", request_id: message.started.request_id,
              prompt_tokens: message.started.prompt_tokens });
    } else if (message.event === "delta") {
      print({ event: "delta", text: message.delta.text, token_ids: message.delta.token_ids });
    } else if (message.event === "finished") {
      const f = message.finished;
      print({ event: "finished", finish_reason: f.finish_reason, prompt_tokens: f.usage.prompt_tokens,
              completion_tokens: f.usage.completion_tokens,
              time_to_first_token_ms: f.timings.time_to_first_token_ms });
    }
  });
  call.on("error", (err) => {
    print({ event: "error", code: grpc.status[err.code], details: err.details });
    client.close();
    process.exitCode = 1;
  });
  call.on("end", () => client.close());
  return 0;
}

process.exitCode = main(process.argv.slice(2));
