"""Agentic tool-use data synthesis (K2 section 3.6): tool repository, agents and tasks with rubrics,
trajectories among a user simulator, the agent and a stateful tool simulator, an LLM judge, SFT output.

- `repository`: `ToolRepository` (OpenAI specs + source), `import_mcp_servers`, `import_openai_json`
- `mcp_import`: `list_mcp_tools`, `MCPSession` (stdio, the official `mcp` SDK 2.x); `servers`: shipped
  MCP servers (`python -m k2_data.agentic.servers.calculator|kvstore|filesystem`)
- `state` + `simulator`: `StateStore` (deterministic CRUD world) and `ToolSimulator` (schema checks, state,
  LLM simulation of everything else)
- `execute`: `MCPExecutor` (MCP tools run for real inside trajectories, one server per trajectory)
- `evolve`: synthetic tools by hierarchical domain evolution (schema checks, MiniLM near-duplicate removal)
- `coverage`: the PCA coverage picture of tool embeddings (PNG); `evaluate`: held-out BFCL/tau-style scores
- `generate` (agents, tasks, rubrics), `user` (user simulator), `trajectory` (rollout), `judge`
- `pipeline`: `AgenticConfig`, `run_agentic` (resumable, cached); `cli`: `k2 data agentic`
- `scripted`: a deterministic teacher for the loopback server (tests, dry runs)

Submodules import on use; the `mcp` SDK is needed only for MCP import (`k2-data[agentic]`).
"""
