// Result rows out: JSON lines, CSV, and a report directory (self-contained index.html with the
// plots embedded, the gnuplot script and its SVGs, summary.md).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cachet/eval/harness.h"
#include "cachet/status.h"

namespace cachet::eval {

// The columns of every row, in order (JSON keys and the CSV header).
const std::vector<std::string>& RowColumns();
nlohmann::ordered_json RowToJson(const ResultRow& row);

Status WriteJsonl(const std::vector<ResultRow>& rows, const std::string& path);
Status WriteCsv(const std::vector<ResultRow>& rows, const std::string& path);

struct ReportMeta {
  std::string command;  // how the rows were made
  std::string date;     // UTC, ISO 8601
  std::string machine;  // CPU model, cores, memory
};
ReportMeta CurrentMeta();  // this process's command line, now, this machine

// Writes DIR/index.html, DIR/summary.md, DIR/plots.gp and the SVGs gnuplot makes from it. Without
// gnuplot on PATH the plots are skipped and both pages say so; the tables are always written.
// *notes gets one line per thing the user should know (e.g. the missing gnuplot).
Status WriteReport(const std::vector<ResultRow>& rows, const std::string& dir,
                   const ReportMeta& meta, std::vector<std::string>* notes);

// The markdown table of the rows (the body of summary.md).
std::string MarkdownTable(const std::vector<ResultRow>& rows);

}  // namespace cachet::eval
