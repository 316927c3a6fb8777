#include "cachet/eval/report.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

namespace cachet::eval {

namespace {

template <class T>
nlohmann::ordered_json Opt(const std::optional<T>& v) {
  return v ? nlohmann::ordered_json(*v) : nlohmann::ordered_json(nullptr);
}

Status WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return InvalidArgument(path + ": cannot open for writing");
  out << text;
  out.close();
  if (!out) return InvalidArgument(path + ": write failed");
  return OkStatus();
}

std::string ReadWhole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string Fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

template <class T>
std::string Cell(const std::optional<T>& v, const char* f, double scale = 1) {
  return v ? Fmt(f, double(*v) * scale) : "-";
}

constexpr double kMiB = 1.0 / (1 << 20);

std::string HtmlEscape(std::string_view s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string Base64(std::string_view in) {
  static const char* kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    const uint32_t v = uint8_t(in[i]) << 16 | uint8_t(in[i + 1]) << 8 | uint8_t(in[i + 2]);
    for (int s : {18, 12, 6, 0}) out += kAlphabet[(v >> s) & 63];
  }
  if (i + 1 == in.size()) {
    const uint32_t v = uint8_t(in[i]) << 16;
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += "==";
  } else if (i + 2 == in.size()) {
    const uint32_t v = uint8_t(in[i]) << 16 | uint8_t(in[i + 1]) << 8;
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += kAlphabet[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

std::string ShellQuote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

std::string MethodName(const ResultRow& r) {
  return r.method.Label() + " @" + CompressAtName(r.method.compress_at);
}

// ---------------------------------------------------------------- plots

struct Series {
  std::string title;
  std::map<double, std::pair<double, double>> sums;  // x -> (sum of y, weight)
  void Add(double x, double y, double w = 1) {
    auto& s = sums[x];
    s.first += y * w;
    s.second += w;
  }
};

struct Plot {
  std::string file, title, xlabel, ylabel, xrange, yrange;
  std::vector<Series> series;
  bool log_y = false;
  Series& Get(const std::string& title) {
    for (Series& s : series) {
      if (s.title == title) return s;
    }
    series.push_back({title, {}});
    return series.back();
  }
};

std::string GnuplotString(std::string_view s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

std::string PlotScript(const std::vector<Plot>& plots) {
  std::ostringstream gp;
  gp << "# Made by cachet eval --report; run `gnuplot plots.gp` in this directory.\n"
     << "set grid\nset key below\n";
  int block = 0;
  for (const Plot& p : plots) {
    // The key goes below the plot, an entry a line (the titles are long): the canvas grows with
    // it, so that a dozen configurations leave the plot its height (they squeezed it to a fifth).
    gp << "set terminal svg size 760," << 380 + 18 * static_cast<int>(p.series.size())
       << " noenhanced font 'sans,12' background rgb 'white'\n";
    std::vector<std::string> names;
    for (const Series& s : p.series) {
      const std::string name = "$d" + std::to_string(block++);
      names.push_back(name);
      gp << name << " << EOD\n";
      for (const auto& [x, sw] : s.sums) gp << x << ' ' << sw.first / sw.second << '\n';
      gp << "EOD\n";
    }
    gp << "set output " << GnuplotString(p.file) << "\nset title " << GnuplotString(p.title)
       << "\nset xlabel " << GnuplotString(p.xlabel) << "\nset ylabel " << GnuplotString(p.ylabel)
       << "\nset xrange " << p.xrange << "\nset yrange " << p.yrange << "\n"
       << (p.log_y ? "set logscale y\n" : "unset logscale y\n") << "plot ";
    // gnuplot's colours repeat after 8: the next eight are dashed, with other points.
    static constexpr int kPoints[] = {7, 5, 9, 11, 13};
    for (size_t i = 0; i < p.series.size(); ++i) {
      gp << (i ? ", \\\n     " : "") << names[i] << " using 1:2 with linespoints lw 2 lt "
         << i % 8 + 1 << " dt " << i / 8 % 5 + 1 << " pt " << kPoints[i / 8 % 5] << " ps 1"
         << " title " << GnuplotString(p.series[i].title);
    }
    gp << "\nunset output\n";
  }
  return gp.str();
}

std::string Range(double lo, double hi) {
  if (!(hi > lo)) hi = lo + 1;  // one point, or all equal: still a valid range
  return "[" + Fmt("%g", lo) + ":" + Fmt("%g", hi) + "]";
}

// The full prefill's row of a multidoc row's cell (same task, length, documents).
const ResultRow* FullOf(const std::vector<ResultRow>& rows, const ResultRow& r) {
  for (const ResultRow& f : rows) {
    if (f.task == r.task && f.length == r.length && f.docs == r.docs && !f.method.blend &&
        f.status == "ok") {
      return &f;
    }
  }
  return nullptr;
}

std::vector<Plot> MakePlots(const std::vector<ResultRow>& rows) {
  std::vector<const ResultRow*> task, kl, reuse;
  for (const ResultRow& r : rows) {
    if (r.status != "ok") continue;
    (r.kind == "kl" ? kl : r.task == "multidoc" ? reuse : task).push_back(&r);
  }
  std::vector<Plot> plots;
  if (!reuse.empty()) {
    Plot p{"reuse_accuracy_vs_ttft.svg",
           "Reused documents: accuracy vs time to first token (multidoc)",
           "TTFT / full prefill's TTFT",
           "exact-match accuracy",
           "[0:1.2]",
           "[0:1.05]",
           {}};
    for (const ResultRow* r : reuse) {
      const ResultRow* full = FullOf(rows, *r);
      if (full == nullptr || !full->ttft_ms || *full->ttft_ms <= 0) continue;
      p.Get(r->method.Label()).Add(*r->ttft_ms / *full->ttft_ms, *r->accuracy, r->samples);
    }
    plots.push_back(std::move(p));
  }
  if (!task.empty()) {
    Plot p{"accuracy_vs_ratio.svg",
           "Accuracy vs compression ratio (mean over lengths)",
           "fraction of KV removed",
           "exact-match accuracy",
           "[-0.05:1]",
           "[0:1.05]",
           {}};
    for (const ResultRow* r : task) {
      const Method& m = r->method;
      const double x = m.budget > 0 ? std::max(0.0, 1.0 - m.budget / r->prompt_tokens) : m.ratio;
      const std::string title = r->task + ": " + (m.press == "full" ? "full" : m.press) + "/" +
                                m.codec_k + (m.codec_v != m.codec_k ? ":" + m.codec_v : "") + " @" +
                                CompressAtName(m.compress_at);
      p.Get(title).Add(x, *r->accuracy, r->samples);
    }
    plots.push_back(std::move(p));
  }
  if (!kl.empty()) {
    double max_kl = 0;
    Plot p{"kl_vs_bits.svg",
           "KL divergence vs bits per stored value",
           "bits per K/V value",
           "mean KL(reference || method), nats",
           "[0:34]",
           "",
           {}};
    for (const ResultRow* r : kl) {
      const Method& m = r->method;
      std::string title = m.press;
      if (m.budget > 0) title += " #" + std::to_string(m.budget);
      if (m.press != "full" && m.budget == 0) title += " @" + Fmt("%g", m.ratio);
      p.Get(title).Add(r->bits_per_value, *r->mean_kl);
      max_kl = std::max(max_kl, *r->mean_kl);
    }
    p.yrange = Range(0, max_kl * 1.1);
    plots.push_back(std::move(p));
  }
  // Memory and speed against context: task rows, or the KL windows when there are none.
  const auto& cost = task.empty() ? kl : task;
  if (!cost.empty()) {
    double max_len = 0, max_mib = 0, max_tps = 0, min_tps = 1e300;
    const std::string x_label = "context length (tokens)";
    Plot mem{"memory_vs_context.svg", "Memory vs context length", x_label, "MiB", "", "", {}};
    Plot speed{"speed_vs_context.svg",
               "Speed vs context length",
               x_label,
               "tokens/s (log scale)",
               "",
               "",
               {}};
    for (const ResultRow* r : cost) {
      const double x = r->length;  // the target: tasks at one length share a point
      max_len = std::max(max_len, x);
      const std::string name = MethodName(*r);
      if (r->kv_bytes_prefill) {
        mem.Get("KV after prefill: " + name).Add(x, *r->kv_bytes_prefill * kMiB);
      }
      if (r->kv_bytes_peak) mem.Get("KV peak: " + name).Add(x, *r->kv_bytes_peak * kMiB);
      if (r->peak_rss_bytes) {
        mem.Get("peak RSS (process, so far)").Add(x, double(*r->peak_rss_bytes) * kMiB);
      }
      if (r->prefill_tok_s) {
        speed.Get("prefill: " + name).Add(x, *r->prefill_tok_s);
        max_tps = std::max(max_tps, *r->prefill_tok_s);
        min_tps = std::min(min_tps, *r->prefill_tok_s);
      }
      if (r->decode_tok_s) {
        speed.Get("decode: " + name).Add(x, *r->decode_tok_s);
        max_tps = std::max(max_tps, *r->decode_tok_s);
        min_tps = std::min(min_tps, *r->decode_tok_s);
      }
    }
    double min_mib = 1e300;
    for (const Series& s : mem.series) {
      for (const auto& [x, sw] : s.sums) {
        max_mib = std::max(max_mib, sw.first / sw.second);
        if (sw.first > 0) min_mib = std::min(min_mib, sw.first / sw.second);
      }
    }
    for (Plot* p : {&mem, &speed}) p->xrange = Range(0, max_len * 1.1);
    mem.yrange = Range(0, max_mib * 1.15);
    if (min_mib < max_mib / 20) {  // the process's RSS beside compressed caches: log, as speed
      mem.log_y = true;
      mem.ylabel = "MiB (log scale)";
      mem.yrange = Range(min_mib / 2, max_mib * 2);
    }
    // Prefill is often 10x decode: a log axis keeps both readable.
    speed.log_y = true;
    speed.yrange = Range(min_tps > 0 && min_tps < 1e300 ? min_tps / 2 : 1, max_tps * 2);
    plots.push_back(std::move(mem));
    if (!speed.series.empty()) plots.push_back(std::move(speed));
  }
  return plots;
}

bool HaveGnuplot() { return std::system("command -v gnuplot >/dev/null 2>&1") == 0; }

std::string FirstLine(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(key, 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos) {
        const size_t a = line.find_first_not_of(" \t", colon + 1);
        return a == std::string::npos ? "" : line.substr(a);
      }
    }
  }
  return "";
}

}  // namespace

nlohmann::ordered_json RowToJson(const ResultRow& r) {
  const Method& m = r.method;
  nlohmann::ordered_json j;
  j["kind"] = r.kind;
  j["status"] = r.status;
  j["reason"] = r.reason;
  j["model"] = r.model;
  j["task"] = r.task;
  j["length"] = r.length;
  j["prompt_tokens"] = r.prompt_tokens;
  j["needles"] = r.needles;
  j["depth"] = r.depth;
  j["method"] = m.Label();
  j["press"] = m.press;
  j["ratio"] = m.ratio;
  j["budget"] = m.budget;
  j["codec_k"] = m.codec_k;
  j["codec_v"] = m.codec_v;
  j["bits_per_value"] = r.bits_per_value;
  j["compress_at"] = CompressAtName(m.compress_at);
  j["seed"] = r.seed;
  j["samples"] = r.samples;
  j["correct"] = r.correct;
  j["accuracy"] = Opt(r.accuracy);
  j["questions"] = r.questions;
  j["question_accuracy"] = r.question_accuracy;
  j["mean_kl"] = Opt(r.mean_kl);
  j["p99_kl"] = Opt(r.p99_kl);
  j["top1_agree"] = Opt(r.top1_agree);
  j["ppl_ref"] = Opt(r.ppl_ref);
  j["ppl"] = Opt(r.ppl);
  j["scored_tokens"] = r.scored_tokens;
  j["kv_bytes_prefill"] = Opt(r.kv_bytes_prefill);
  j["kv_bytes_peak"] = Opt(r.kv_bytes_peak);
  j["kv_bits_held"] = Opt(r.kv_bits_held);
  j["kv_pool_high_water_bytes"] = Opt(r.kv_pool_high_water_bytes);
  j["peak_rss_bytes"] = Opt(r.peak_rss_bytes);
  j["prefill_tok_s"] = Opt(r.prefill_tok_s);
  j["decode_tok_s"] = Opt(r.decode_tok_s);
  j["ttft_ms"] = Opt(r.ttft_ms);
  j["docs"] = r.docs;
  j["blend"] = m.blend ? BlendName(*m.blend) : "";
  j["answer_kl"] = Opt(r.answer_kl);
  j["recomputed_fraction"] = Opt(r.recomputed_fraction);
  j["reused_cache"] = r.reused_cache;
  j["cache_file_bytes"] = Opt(r.cache_file_bytes);
  j["threads"] = r.threads;
  j["cell_wall_s"] = r.wall_s;
  return j;
}

// The CSV's columns are the JSON rows' keys, in order: one list (the CSV lacked four of them).
const std::vector<std::string>& RowColumns() {
  static const std::vector<std::string> kColumns = [] {
    std::vector<std::string> names;
    const nlohmann::ordered_json row = RowToJson(ResultRow{});
    for (const auto& [key, value] : row.items()) names.push_back(key);
    return names;
  }();
  return kColumns;
}

Status WriteJsonl(const std::vector<ResultRow>& rows, const std::string& path) {
  std::string text;
  for (const ResultRow& r : rows) text += RowToJson(r).dump() + "\n";
  return WriteFile(path, text);
}

Status WriteCsv(const std::vector<ResultRow>& rows, const std::string& path) {
  std::string text;
  for (const std::string& c : RowColumns()) text += (text.empty() ? "" : ",") + c;
  text += "\n";
  for (const ResultRow& r : rows) {
    const nlohmann::ordered_json j = RowToJson(r);
    bool first = true;
    for (const std::string& c : RowColumns()) {
      if (!first) text += ',';
      first = false;
      const auto& v = j[c];
      if (v.is_null()) continue;
      std::string s = v.is_string() ? v.get<std::string>() : v.dump();
      if (s.find_first_of(",\"\n") != std::string::npos) {
        std::string q = "\"";
        for (char ch : s) q += ch == '"' ? std::string("\"\"") : std::string(1, ch);
        s = q + "\"";
      }
      text += s;
    }
    text += '\n';
  }
  return WriteFile(path, text);
}

ReportMeta CurrentMeta() {
  ReportMeta m;
  std::string cmd = ReadWhole("/proc/self/cmdline");
  for (char& c : cmd) {
    if (c == '\0') c = ' ';
  }
  while (!cmd.empty() && cmd.back() == ' ') cmd.pop_back();
  m.command = cmd;
  const std::time_t now = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  m.date = buf;
  std::string cpu = FirstLine("/proc/cpuinfo", "model name");
  if (cpu.empty()) cpu = "unknown CPU";
  m.machine = cpu + ", " + std::to_string(std::thread::hardware_concurrency()) + " cores";
  const std::string mem = FirstLine("/proc/meminfo", "MemTotal");
  if (!mem.empty()) m.machine += ", " + mem + " memory";
  return m;
}

// multiq, multiturn: " (0.95 0.90 ...)", each question's accuracy in the order asked.
std::string ByQuestion(const ResultRow& r) {
  if (r.question_accuracy.empty()) return "";
  std::string out = " (";
  for (size_t q = 0; q < r.question_accuracy.size(); ++q) {
    if (q > 0) out += ' ';
    out += Fmt("%.2f", r.question_accuracy[q]);
  }
  return out + ")";
}

std::string MarkdownTable(const std::vector<ResultRow>& rows) {
  std::ostringstream md;
  bool task_header = false, kl_header = false;
  for (const ResultRow& r : rows) {
    if (r.kind != "task" || r.task == "multidoc") continue;
    if (!task_header) {
      md << "| task | length | tokens | needles | depth | method | compress_at | accuracy | n "
            "| KV prefill MiB | KV peak MiB | peak RSS MiB | prefill tok/s | decode tok/s | "
            "TTFT ms |\n"
         << "| --- | ---: | ---: | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | "
            "---: | ---: | ---: |\n";
      task_header = true;
    }
    const std::string task = r.task == "niah" ? "niah" + std::to_string(r.needles) : r.task;
    md << "| " << task << " | " << r.length << " | "
       << (r.status == "ok" ? Fmt("%.0f", r.prompt_tokens) : "-") << " | " << r.needles << " | "
       << r.depth << " | " << r.method.Label() << " | " << CompressAtName(r.method.compress_at)
       << (r.reused_cache ? " (reused file)" : "") << " | "
       << (r.status == "ok" ? Fmt("%.3f", *r.accuracy) + ByQuestion(r) : "unavailable: " + r.reason)
       << " | " << r.samples << " | " << Cell(r.kv_bytes_prefill, "%.2f", kMiB) << " | "
       << Cell(r.kv_bytes_peak, "%.2f", kMiB) << " | " << Cell(r.peak_rss_bytes, "%.0f", kMiB)
       << " | " << Cell(r.prefill_tok_s, "%.0f") << " | " << Cell(r.decode_tok_s, "%.0f") << " | "
       << Cell(r.ttft_ms, "%.1f") << " |\n";
  }
  for (const ResultRow& r : rows) {
    if (r.kind != "kl") continue;
    if (!kl_header) {
      if (task_header) md << "\n";
      md << "| method | window | windows | scored | mean KL | p99 KL | top-1 agree | PPL ref | "
            "PPL | KV prefill MiB | KV peak MiB | bits held | peak RSS MiB | tok/s |\n"
         << "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
            "---: | ---: |\n";
      kl_header = true;
    }
    md << "| " << r.method.Label() << " | " << r.length << " | " << r.samples << " | "
       << r.scored_tokens << " | "
       << (r.status == "ok" ? Fmt("%.6f", *r.mean_kl) : "unavailable: " + r.reason) << " | "
       << Cell(r.p99_kl, "%.6f") << " | " << Cell(r.top1_agree, "%.4f") << " | "
       << Cell(r.ppl_ref, "%.3f") << " | " << Cell(r.ppl, "%.3f") << " | "
       << Cell(r.kv_bytes_prefill, "%.2f", kMiB) << " | " << Cell(r.kv_bytes_peak, "%.2f", kMiB)
       << " | " << Cell(r.kv_bits_held, "%.2f") << " | " << Cell(r.peak_rss_bytes, "%.0f", kMiB)
       << " | " << Cell(r.prefill_tok_s, "%.0f") << " |\n";
  }
  bool reuse_header = false;
  for (const ResultRow& r : rows) {
    if (r.kind != "task" || r.task != "multidoc") continue;
    if (!reuse_header) {
      if (task_header || kl_header) md << "\n";
      md << "| task | length | docs | method | accuracy | answer KL | recomputed | TTFT ms | "
            "TTFT / full | n |\n"
         << "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n";
      reuse_header = true;
    }
    const ResultRow* full = FullOf(rows, r);
    const std::string vs_full = full && full->ttft_ms && r.ttft_ms && *full->ttft_ms > 0
                                    ? Fmt("%.2f", *r.ttft_ms / *full->ttft_ms)
                                    : "-";
    md << "| " << r.task << " | " << r.length << " | " << r.docs << " | " << r.method.Label()
       << " | " << Cell(r.accuracy, "%.3f") << " | " << Cell(r.answer_kl, "%.4f") << " | "
       << Cell(r.recomputed_fraction, "%.3f") << " | " << Cell(r.ttft_ms, "%.1f") << " | "
       << vs_full << " | " << r.samples << " |\n";
  }
  return md.str();
}

Status WriteReport(const std::vector<ResultRow>& rows, const std::string& dir,
                   const ReportMeta& meta, std::vector<std::string>* notes) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return InvalidArgument(dir + ": cannot create the report directory: " + ec.message());

  const std::vector<Plot> plots = MakePlots(rows);
  CACHET_RETURN_IF_ERROR(WriteFile(dir + "/plots.gp", PlotScript(plots)));
  std::vector<std::string> made;  // SVGs gnuplot wrote
  if (plots.empty()) {
    notes->push_back("no runnable rows: nothing to plot");
  } else if (!HaveGnuplot()) {
    notes->push_back(
        "gnuplot not found on PATH: plots skipped (install gnuplot-nox, then run `gnuplot "
        "plots.gp` in " +
        dir + "); the tables hold all the data");
  } else {
    const std::string cmd = "cd " + ShellQuote(dir) + " && gnuplot plots.gp > gnuplot.log 2>&1";
    if (std::system(cmd.c_str()) != 0) {
      notes->push_back("gnuplot failed (see " + dir + "/gnuplot.log); plots may be missing");
    }
    for (const Plot& p : plots) {
      if (std::filesystem::exists(dir + "/" + p.file, ec)) made.push_back(p.file);
    }
  }

  const std::string table = MarkdownTable(rows);
  std::ostringstream md;
  md << "# cachet eval\n\n- command: `" << meta.command << "`\n- date: " << meta.date
     << "\n- machine: " << meta.machine << "\n";
  for (const std::string& n : *notes) md << "- note: " << n << "\n";
  md << "\n" << table;
  CACHET_RETURN_IF_ERROR(WriteFile(dir + "/summary.md", md.str()));

  std::ostringstream html;
  html << "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>cachet eval</title>\n"
       << "<style>body{font-family:sans-serif;margin:2em;max-width:1400px}"
          "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;"
          "padding:3px 6px;text-align:right}td:nth-child(-n+7),th{text-align:left}"
          "figure{display:inline-block;margin:0.5em}code{background:#f4f4f4}</style>\n"
       << "</head><body>\n<h1>cachet eval</h1>\n<ul>\n<li>command: <code>"
       << HtmlEscape(meta.command) << "</code></li>\n<li>date: " << HtmlEscape(meta.date)
       << "</li>\n<li>machine: " << HtmlEscape(meta.machine) << "</li>\n";
  for (const std::string& n : *notes) html << "<li>note: " << HtmlEscape(n) << "</li>\n";
  html << "</ul>\n";
  for (const std::string& f : made) {
    html << "<figure><img alt=\"" << HtmlEscape(f) << "\" src=\"data:image/svg+xml;base64,"
         << Base64(ReadWhole(dir + "/" + f)) << "\"></figure>\n";
  }
  // The markdown tables, as HTML.
  html << "<h2>Results</h2>\n";
  std::istringstream lines(table);
  bool in_table = false, header = false;
  for (std::string line; std::getline(lines, line);) {
    if (line.empty()) {
      if (in_table) html << "</table>\n<br>\n";
      in_table = false;
      continue;
    }
    if (line.rfind("| ---", 0) == 0) continue;
    if (!in_table) html << "<table>\n", in_table = true, header = true;
    html << "<tr>";
    std::string cell;
    std::istringstream cells(line.substr(1));
    while (std::getline(cells, cell, '|')) {
      const size_t a = cell.find_first_not_of(' '), b = cell.find_last_not_of(' ');
      const std::string text = a == std::string::npos ? "" : cell.substr(a, b - a + 1);
      html << (header ? "<th>" : "<td>") << HtmlEscape(text) << (header ? "</th>" : "</td>");
    }
    html << "</tr>\n";
    header = false;
  }
  if (in_table) html << "</table>\n";
  html << "<p>Columns and methodology: docs/EVAL.md. KV bytes are this configuration's own pages "
          "(page bytes include each token's position); peak RSS and the pool high water are "
          "process-wide.</p>\n</body></html>\n";
  return WriteFile(dir + "/index.html", html.str());
}

}  // namespace cachet::eval
