// cachet: a KV-cache-centric LLM inference engine. `cachet --help` lists the subcommands.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>

#include "commands.h"

int main(int argc, char** argv) {
  // llama.cpp's spelling of --np (CLI11 takes one-letter short options only).
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "-np") == 0) argv[i] = const_cast<char*>("--np");
  }
  CLI::App app{
      "cachet: LLM inference on CPU built around a paged, compressible KV cache.\n"
      "Every subcommand defaults to the embedded kvtiny model (-m to use another HF model dir)."};
  app.require_subcommand(1);
  app.set_version_flag("--version", "cachet 0.1.0");
  cachet::cli::AddRun(app);
  cachet::cli::AddChat(app);
  cachet::cli::AddInspect(app);
  cachet::cli::AddBench(app);
  cachet::cli::AddEval(app);
  cachet::cli::AddConvert(app);
  cachet::cli::AddCalibrate(app);
  cachet::cli::AddServe(app);
  cachet::cli::AddCache(app);
  // A first word that is no command is named as such (CLI11 said "A subcommand is required").
  if (argc > 1 && argv[1][0] != '-') {
    std::string names;
    bool known = false;
    for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
      known |= sub->get_name() == argv[1];
      names += (names.empty() ? "" : ", ") + sub->get_name();
    }
    if (!known) {
      std::fprintf(stderr, "cachet: unknown command '%s' (commands: %s; cachet --help)\n", argv[1],
                   names.c_str());
      return 109;  // CLI11's code for a subcommand that does not exist
    }
  }
  CLI11_PARSE(app, argc, argv);
  // Output that never reached stdout (a full disk, a closed pipe) fails the command.
  std::cout.flush();
  errno = 0;
  if (std::fflush(stdout) != 0 || std::ferror(stdout) || !std::cout) {
    std::fprintf(stderr, "cachet: writing to stdout failed%s%s\n", errno ? ": " : "",
                 errno ? std::strerror(errno) : "");
    return 1;
  }
  return 0;
}
