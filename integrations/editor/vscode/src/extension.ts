// agentspec for VS Code: a thin client of the agentspec language server (`agentspec lsp`).
//
// The server does the work: it rewrites a range (or a whole file) or merges an edit snippet,
// sends the result back as `workspace/applyEdit`, and reports progress with `$/progress`
// (which the language client shows, with a cancel button). This extension starts the server,
// passes the settings along, and offers two commands that call the server's own commands.
//
// vscode-languageclient registers the server's command ids (`agentspec.rewrite`,
// `agentspec.apply`) in VS Code itself (so that the server's code actions can run them),
// which is why the user-facing commands here are `agentspec.editor.*`.

import * as vscode from "vscode";
import {
  ExecuteCommandRequest,
  LanguageClient,
  LanguageClientOptions,
  Middleware,
  ServerOptions,
  TransportKind,
} from "vscode-languageclient/node";

const SECTION = "agentspec";
const SERVER_REWRITE = "agentspec.rewrite";
const SERVER_APPLY = "agentspec.apply";
const EDITOR_REWRITE = "agentspec.editor.rewrite";
const EDITOR_APPLY = "agentspec.editor.apply";

/** Settings the server receives as `initializationOptions` (and, by section "agentspec",
 * through `workspace/configuration` and `workspace/didChangeConfiguration`). No `url`: the
 * server loads the model in its own process; `config` gives that in-process server its routes. */
interface ServerSettings {
  url: string | null;
  apiKey: string | null;
  model: string | null;
  config: string | null;
  route: string | null;
}

/** What `agentspec.rewrite` and `agentspec.apply` return. */
interface EditResult {
  applied: boolean;
  reason?: string;
  completion_tokens: number;
  mat: number;
  seconds: number;
}

let client: LanguageClient | undefined;
let starting: Promise<void> | undefined;

function serverSettings(): ServerSettings {
  const cfg = vscode.workspace.getConfiguration(SECTION);
  const text = (key: string): string | null => {
    const value = cfg.get<string | null>(key);
    return typeof value === "string" && value.trim() !== "" ? value : null;
  };
  return {
    url: text("url"),
    apiKey: text("apiKey"),
    model: text("model"),
    config: text("config"),
    route: text("route"),
  };
}

function isEditResult(value: unknown): value is EditResult {
  return typeof value === "object" && value !== null && typeof (value as EditResult).applied === "boolean";
}

function report(result: unknown): void {
  if (!isEditResult(result)) {
    return;
  }
  if (!result.applied) {
    void vscode.window.showWarningMessage(`agentspec: not applied: ${result.reason ?? "no reason given"}`);
    return;
  }
  const mat = typeof result.mat === "number" ? result.mat.toFixed(2) : "?";
  const seconds = typeof result.seconds === "number" ? result.seconds.toFixed(1) : "?";
  void vscode.window.showInformationMessage(
    `agentspec: applied (${result.completion_tokens} tokens, MAT ${mat}, ${seconds} s)`,
  );
}

function showFailure(error: unknown): void {
  const message = error instanceof Error ? error.message : String(error);
  void vscode.window.showErrorMessage(`agentspec: ${message}`);
}

function askInstruction(): Thenable<string | undefined> {
  return vscode.window.showInputBox({
    title: "agentspec: Rewrite",
    prompt: "How should the code be rewritten?",
    placeHolder: "e.g. add type hints and a docstring",
    ignoreFocusOut: true,
    validateInput: (value) => (value.trim() === "" ? "Enter an instruction" : undefined),
  });
}

/** Runs for the server's commands when VS Code invokes them (the server's code actions):
 * asks for a missing rewrite instruction, and reports the outcome. */
const middleware: Middleware = {
  executeCommand: async (command, args, next) => {
    if (command === SERVER_REWRITE) {
      const [first, ...rest] = args;
      const arg = typeof first === "object" && first !== null ? (first as Record<string, unknown>) : {};
      if (typeof arg.instruction !== "string" || arg.instruction.trim() === "") {
        const instruction = await askInstruction();
        if (instruction === undefined) {
          return undefined; // cancelled: do nothing
        }
        args = [{ ...arg, instruction }, ...rest];
      }
    }
    try {
      const result: unknown = await next(command, args);
      if (command === SERVER_REWRITE || command === SERVER_APPLY) {
        report(result);
      }
      return result;
    } catch (error) {
      showFailure(error);
      return undefined;
    }
  },
};

function createClient(): LanguageClient {
  const cfg = vscode.workspace.getConfiguration(SECTION);
  const command = cfg.get<string>("command")?.trim() || "agentspec";
  const args = cfg.get<string[]>("args") ?? ["lsp"];
  const serverOptions: ServerOptions = { command, args, transport: TransportKind.stdio };
  const clientOptions: LanguageClientOptions = {
    documentSelector: [{ scheme: "file" }],
    initializationOptions: serverSettings(),
    // later changes reach the server as workspace/didChangeConfiguration
    synchronize: { configurationSection: SECTION },
    middleware,
  };
  return new LanguageClient("agentspec", "agentspec", serverOptions, clientOptions);
}

function startClient(): void {
  const c = createClient();
  client = c;
  starting = c.start().catch((error: unknown) => {
    showFailure(`could not start the language server (${c.outputChannel.name} output has details): ${
      error instanceof Error ? error.message : String(error)}`);
    throw error;
  });
  starting.catch(() => undefined); // reported above; commands wait on it again
}

async function stopClient(): Promise<void> {
  const c = client;
  client = undefined;
  starting = undefined;
  if (c !== undefined) {
    try {
      await c.stop();
    } catch {
      // it may never have started
    }
  }
}

/** The running client, or undefined (and an error shown) when the server is not up. */
async function readyClient(): Promise<LanguageClient | undefined> {
  if (client === undefined || starting === undefined) {
    startClient();
  }
  try {
    await starting;
  } catch {
    return undefined;
  }
  return client;
}

/** The active editor's document, if the server can see it (file scheme, as the selector). */
function activeFileEditor(): vscode.TextEditor | undefined {
  const editor = vscode.window.activeTextEditor;
  if (editor === undefined) {
    void vscode.window.showErrorMessage("agentspec: no active editor");
    return undefined;
  }
  if (editor.document.uri.scheme !== "file") {
    void vscode.window.showErrorMessage("agentspec: save the document to a file first");
    return undefined;
  }
  return editor;
}

async function runServerCommand(c: LanguageClient, command: string, arg: object): Promise<void> {
  try {
    const result: unknown = await c.sendRequest(ExecuteCommandRequest.type, { command, arguments: [arg] });
    report(result);
  } catch (error) {
    showFailure(error);
  }
}

async function rewrite(): Promise<void> {
  const editor = activeFileEditor();
  if (editor === undefined) {
    return;
  }
  const instruction = await askInstruction();
  if (instruction === undefined) {
    return;
  }
  const c = await readyClient();
  if (c === undefined) {
    return;
  }
  const selection = editor.selection;
  const range = selection.isEmpty ? undefined : c.code2ProtocolConverter.asRange(selection);
  const uri = c.code2ProtocolConverter.asUri(editor.document.uri);
  await runServerCommand(c, SERVER_REWRITE, range === undefined ? { uri, instruction } : { uri, range, instruction });
}

async function apply(): Promise<void> {
  const editor = activeFileEditor();
  if (editor === undefined) {
    return;
  }
  const update = await vscode.env.clipboard.readText();
  if (update.trim() === "") {
    void vscode.window.showErrorMessage("agentspec: the clipboard is empty (copy an edit snippet first)");
    return;
  }
  const c = await readyClient();
  if (c === undefined) {
    return;
  }
  const uri = c.code2ProtocolConverter.asUri(editor.document.uri);
  await runServerCommand(c, SERVER_APPLY, { uri, update });
}

export function activate(context: vscode.ExtensionContext): void {
  context.subscriptions.push(
    vscode.commands.registerCommand(EDITOR_REWRITE, rewrite),
    vscode.commands.registerCommand(EDITOR_APPLY, apply),
    vscode.workspace.onDidChangeConfiguration(async (event) => {
      // the server command itself changed: start a new server
      if (event.affectsConfiguration(`${SECTION}.command`) || event.affectsConfiguration(`${SECTION}.args`)) {
        await stopClient();
        startClient();
      }
    }),
  );
  startClient();
}

export function deactivate(): Thenable<void> | undefined {
  return stopClient();
}
