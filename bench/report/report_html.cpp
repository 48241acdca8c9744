// The bench report: one self-contained HTML page, every chart an inline SVG (no scripts, no
// external files), so it opens anywhere and renders the same in a headless browser.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "bench/report/bench_results.h"

namespace sg::report {

namespace {

const char* kPalette[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#9c755f"};

std::string escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '<') o += "&lt;";
    else if (c == '>') o += "&gt;";
    else if (c == '&') o += "&amp;";
    else if (c == '\'') o += "&#39;";
    else if (c == '"') o += "&quot;";
    else o += c;
  }
  return o;
}

std::string human(double v, const std::string& unit) {
  const char* prefix[] = {"", "K", "M", "G", "T"};
  int i = 0;
  const double base = unit == "B" ? 1024 : 1000;
  while (std::abs(v) >= base && i < 4) v /= base, ++i;
  char buf[48];
  std::snprintf(buf, sizeof buf, "%.3g %s%s%s", v, prefix[i], unit == "B" && i ? "i" : "", unit.c_str());
  return buf;
}

// A duration: "8.44 ms", "1.52 s".
std::string millis(double ms) {
  char buf[32];
  if (std::abs(ms) < 1000) std::snprintf(buf, sizeof buf, "%.3g ms", ms);
  else std::snprintf(buf, sizeof buf, "%.3g s", ms / 1e3);
  return buf;
}

// Horizontal bars, one per row, each stacked from the series in order; a legend on top.
// labels: each bar's text instead of its total (the memory chart's: the peak of the sum, which
// the stacked per-category peaks overstate when the categories peak at different moments).
std::string stacked_bars(const std::string& id, const std::string& title, const std::vector<std::string>& rows,
                         const std::vector<std::string>& series, const std::vector<std::vector<double>>& values,
                         const std::string& unit, const std::vector<std::string>& labels = {}) {
  const double label_w = 190, bar_w = 560, row_h = 22, top = 56;
  double max_total = 0;
  for (const auto& v : values) {
    double t = 0;
    for (double x : v) t += x;
    max_total = std::max(max_total, t);
  }
  const double scale = max_total > 0 ? bar_w / max_total : 0;
  std::ostringstream o;
  o << "<svg id='" << id << "' xmlns='http://www.w3.org/2000/svg' width='" << label_w + bar_w + 120 << "' height='"
    << top + row_h * double(rows.size()) + 20 << "' font-family='sans-serif' font-size='12'>\n";
  o << "<text x='4' y='18' font-size='15' font-weight='bold'>" << escape(title) << "</text>\n";
  double lx = 4;
  for (size_t s = 0; s < series.size(); ++s) {
    o << "<rect x='" << lx << "' y='28' width='12' height='12' fill='" << kPalette[s % 8] << "'/><text x='" << lx + 16
      << "' y='39'>" << escape(series[s]) << "</text>\n";
    lx += 24 + 7.0 * double(series[s].size());
  }
  for (size_t r = 0; r < rows.size(); ++r) {
    const double y = top + row_h * double(r);
    o << "<text x='" << label_w - 6 << "' y='" << y + 15 << "' text-anchor='end'>" << escape(rows[r]) << "</text>\n";
    double x = label_w, total = 0;
    for (size_t s = 0; s < series.size() && s < values[r].size(); ++s) {
      const double w = values[r][s] * scale;
      total += values[r][s];
      if (w <= 0) continue;
      o << "<rect x='" << x << "' y='" << y + 3 << "' width='" << w << "' height='" << row_h - 6 << "' fill='"
        << kPalette[s % 8] << "'><title>" << escape(rows[r] + ": " + series[s] + " " + human(values[r][s], unit))
        << "</title></rect>\n";
      x += w;
    }
    o << "<text x='" << x + 6 << "' y='" << y + 15 << "' fill='#444'>"
      << escape(r < labels.size() ? labels[r] : human(total, unit)) << "</text>\n";
  }
  o << "</svg>\n";
  return o.str();
}

// Memory over one step of a layout: a panel per rank (rank 0 and the rank with the largest peak
// when there are more than 4), the ledger's bytes stacked by category as step functions (a counter
// holds its value until the next sample), one tick per sample on the time axis. The y scale is
// shared by the panels; each panel's x axis is its own step.
std::string memory_over_time(const std::string& id, const std::string& name, const nlohmann::json& timeline,
                             const std::vector<std::string>& cats) {
  const auto& ranks = timeline.at("ranks");
  auto total_at = [&](const nlohmann::json& r, size_t j) {
    double t = 0;
    for (const auto& c : cats)
      if (r["bytes"].contains(c)) t += r["bytes"][c][j].get<double>();
    return t;
  };
  auto peak_of = [&](const nlohmann::json& r) {
    double p = 0;
    for (size_t j = 0; j < r["t_ms"].size(); ++j) p = std::max(p, total_at(r, j));
    return p;
  };
  std::vector<size_t> shown;
  if (ranks.size() <= 4) {
    for (size_t k = 0; k < ranks.size(); ++k) shown.push_back(k);
  } else {
    size_t top = 1;
    for (size_t k = 1; k < ranks.size(); ++k)
      if (peak_of(ranks[k]) > peak_of(ranks[top])) top = k;
    shown = {0, top};
  }
  double ymax = 0;
  for (size_t k : shown) ymax = std::max(ymax, peak_of(ranks[k]));
  const double width = 1000, left = 70, gap = 24, top = 58, plot_h = 150, bottom = 36;
  const double panel_w = (width - left - 10 - gap * double(shown.size() - 1)) / double(shown.size());
  const double yscale = ymax > 0 ? plot_h / ymax : 0;
  std::ostringstream o;
  o << "<svg id='" << escape(id) << "' data-samples='" << ranks[0]["t_ms"].size()
    << "' xmlns='http://www.w3.org/2000/svg' width='" << width << "' height='" << top + plot_h + bottom
    << "' font-family='sans-serif' font-size='11'>\n<rect width='100%' height='100%' fill='white'/>\n";
  o << "<text x='4' y='16' font-size='14' font-weight='bold'>" << escape(name) << " — step "
    << timeline.value("step", int64_t(0)) << "</text>\n";
  double lx = 4;
  for (size_t c = 0; c < cats.size(); ++c) {
    o << "<rect x='" << lx << "' y='26' width='11' height='11' fill='" << kPalette[c % 8] << "'/><text x='" << lx + 15
      << "' y='36'>" << escape(cats[c]) << "</text>\n";
    lx += 22 + 6.5 * double(cats[c].size());
  }
  const double base = top + plot_h;
  for (double f : {0.0, 0.5, 1.0}) {  // the shared y axis
    const double y = base - f * plot_h;
    o << "<line x1='" << left << "' x2='" << width - 10 << "' y1='" << y << "' y2='" << y << "' stroke='#ddd'/>"
      << "<text x='" << left - 4 << "' y='" << y + 4 << "' text-anchor='end' fill='#444'>" << human(f * ymax, "B")
      << "</text>\n";
  }
  for (size_t p = 0; p < shown.size(); ++p) {
    const auto& r = ranks[shown[p]];
    const auto& t = r["t_ms"];
    const size_t n = t.size();
    const double x0 = left + double(p) * (panel_w + gap), span = std::max(1e-9, r.value("step_ms", 0.0));
    auto x = [&](double ms) { return x0 + std::clamp(ms / span, 0.0, 1.0) * panel_w; };
    std::vector<double> below(n, 0.0);
    for (size_t c = 0; c < cats.size(); ++c) {
      if (!r["bytes"].contains(cats[c])) continue;
      const auto& v = r["bytes"][cats[c]];
      std::vector<double> above(n);
      double most = 0;
      for (size_t j = 0; j < n; ++j) above[j] = below[j] + v[j].get<double>(), most = std::max(most, v[j].get<double>());
      if (most > 0 && n > 0) {  // the top edge left to right, then the bottom edge back, both as steps
        std::ostringstream d;
        d << "M" << x(t[0].get<double>()) << "," << base - above[0] * yscale;
        for (size_t j = 0; j < n; ++j) {
          const double x_next = j + 1 < n ? x(t[j + 1].get<double>()) : x0 + panel_w;
          d << " H" << x_next;
          if (j + 1 < n) d << " V" << base - above[j + 1] * yscale;
        }
        d << " V" << base - below[n - 1] * yscale;
        for (size_t j = n; j-- > 0;) {
          d << " H" << x(t[j].get<double>());
          if (j > 0) d << " V" << base - below[j - 1] * yscale;
        }
        o << "<path d='" << d.str() << " Z' fill='" << kPalette[c % 8] << "'><title>"
          << escape(name + " rank " + std::to_string(r["rank"].get<int>()) + ": " + cats[c] + ", up to " + human(most, "B"))
          << "</title></path>\n";
      }
      below = above;
    }
    for (size_t j = 0; j < n; ++j)  // where the ledger was sampled
      o << "<line x1='" << x(t[j].get<double>()) << "' x2='" << x(t[j].get<double>()) << "' y1='" << base << "' y2='"
        << base + 5 << "' stroke='#666'/>\n";
    o << "<line x1='" << x0 << "' x2='" << x0 + panel_w << "' y1='" << base << "' y2='" << base << "' stroke='#444'/>\n";
    o << "<text x='" << x0 << "' y='" << base + 18 << "'>0</text><text x='" << x0 + panel_w << "' y='" << base + 18
      << "' text-anchor='end'>" << millis(span) << "</text>\n";
    o << "<text x='" << x0 + panel_w / 2 << "' y='" << base + 30 << "' text-anchor='middle'>rank " << r["rank"].get<int>()
      << (ranks.size() > 4 && p > 0 ? " (largest peak)" : "") << " · " << n << " samples · peak "
      << human(peak_of(r), "B") << "</text>\n";
  }
  o << "</svg>\n";
  return o.str();
}

}  // namespace

std::string results_html(const nlohmann::json& results) {
  static const std::vector<std::string> cats = {"param", "grad", "optim_state", "activation", "comm_buffer", "workspace"};
  static const std::vector<std::string> kinds = {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "send"};
  std::vector<std::string> mem_rows, mem_labels, tput_rows, comm_rows;
  std::vector<std::vector<double>> mem_vals, tput_vals, comm_vals;
  std::ostringstream gantt, memtime, table, refused;
  for (const auto& r : results.at("layouts")) {
    const std::string name = r["name"].get<std::string>();
    if (r["status"] != "ok") {
      refused << "<tr><td>" << escape(name) << "</td><td>" << r["ranks"].get<int>() << "</td><td>"
              << escape(r["status"].get<std::string>()) << "</td><td>" << escape(r.value("reason", std::string()))
              << "</td></tr>\n";
      continue;
    }
    const auto& m = r["measured"];
    const bool timed = m.contains("tokens_per_s");  // not under bench --simulate
    if (timed) {
      tput_rows.push_back(name);
      tput_vals.push_back({m["tokens_per_s"].get<double>()});
    }
    if (m.contains("mem_peak"))
      for (size_t k = 0; k < m["mem_peak"].size(); ++k) {
        mem_rows.push_back(name + " / rank " + std::to_string(k));
        std::vector<double> v;
        for (const auto& c : cats) v.push_back(double(m["mem_peak"][k].value(c, int64_t(0))));
        mem_vals.push_back(v);
        double sum = 0;
        for (double x : v) sum += x;
        const double total = double(m["mem_peak"][k].value("total", int64_t(0)));
        mem_labels.push_back(total > 0 ? "peak " + human(total, "B") : human(sum, "B"));
      }
    if (m.contains("comm_per_step")) {
      comm_rows.push_back(name);
      std::vector<double> v;
      for (const auto& k : kinds) v.push_back(m["comm_per_step"][0].value(k, 0.0));
      comm_vals.push_back(v);
    }
    if (r.contains("memory_timeline") && !r["memory_timeline"].is_null())
      memtime << "<div class='memtime'>" << memory_over_time("chart-memtime-" + name, name, r["memory_timeline"], cats)
              << "</div>\n";
    if (r.contains("timeline_svg"))
      gantt << "<h3>" << escape(name) << "</h3>\n<div class='gantt'>" << r["timeline_svg"].get<std::string>() << "</div>\n";
    table << "<tr><td>" << escape(name) << "</td><td>" << r["ranks"].get<int>() << "</td><td>";
    if (timed)
      table << millis(m["step_ms"].get<double>())
            << (m.contains("step_ms_range") ? " (" + millis(m["step_ms_range"][0].get<double>()) + "–" +
                                                   millis(m["step_ms_range"][1].get<double>()) + ")"
                                             : std::string())
            << "</td><td>" << human(m["tokens_per_s"].get<double>(), "tok/s")
            << (m.contains("mfu") ? " (MFU " + human(100 * m["mfu"].get<double>(), "%") + ")" : std::string());
    else
      table << "simulated</td><td>";
    table << "</td><td>";
    if (m.contains("bubble")) {  // the schedule's (p-1)/(v m) / measured
      if (r.contains("predicted") && r["predicted"].value("bubble", 0.0) > 0)
        table << human(100 * r["predicted"]["bubble"].get<double>(), "%") << " / ";
      table << human(100 * m["bubble"].get<double>(), "%");
    }
    table << "</td>";
    if (r.contains("predicted") && r["predicted"].contains("param") && m.contains("mem_peak")) {
      const auto& p = r["predicted"];
      auto cell = [&](const char* what, double want, double got, double peak = 0, const std::string& extra = "") {
        table << "<td title='" << what << "'>" << human(want, "B") << " / " << human(got, "B");
        if (got > 0) table << " (" << std::lround(100 * (want - got) / got) << "%)";
        if (peak > got) table << "; peak " << human(peak, "B");
        table << extra << "</td>";
      };
      // The parameters the rank keeps between steps (the planner's figure), and, where units are
      // gathered during the step (ZeRO-3/FSDP), their peak.
      const double param_peak = double(m["mem_peak"][0].value("param", int64_t(0)));
      if (m.contains("mem_end"))
        cell("param", p["param"].get<double>(), double(m["mem_end"][0].value("param", int64_t(0))), param_peak);
      else
        cell("param", p["param"].get<double>(), param_peak);
      // --offload: what went to host memory, beside what stayed on the device
      const std::string host = m.contains("mem_host_peak")
                                   ? "; host " + human(double(m["mem_host_peak"].value("optim_state", int64_t(0))), "B")
                                   : std::string();
      cell("optimizer", p["optim_state"].get<double>(), double(m["mem_peak"][0].value("optim_state", int64_t(0))), 0, host);
      cell("activation", p["activation"].get<double>(), double(m["mem_peak"][0].value("activation", int64_t(0))));
      double sent = 0;
      for (const auto& k : kinds) sent += m["comm_per_step"][0].value(k, 0.0);
      cell("bytes sent per step", p["comm_bytes"].get<double>(), sent);
    } else {
      table << "<td colspan='4'>not modelled</td>";
    }
    table << "</tr>\n";
  }
  std::ostringstream o;
  o << "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><title>shardgrad bench</title>\n"
    << "<style>body{font-family:sans-serif;margin:24px;max-width:1100px}table{border-collapse:collapse;font-size:13px}"
       "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}td:first-child{text-align:left}"
       "h2{margin-top:32px}.gantt svg,.memtime svg{max-width:100%}</style></head><body>\n";
  o << "<h1>shardgrad bench</h1>\n<p>" << escape(results.value("description", std::string())) << "</p>\n";
  if (results.contains("command")) o << "<p><code>" << escape(results["command"].get<std::string>()) << "</code></p>\n";
  o << "<h2>Peak memory per rank, by ledger category</h2>\n"
    << stacked_bars("chart-memory", "each category's peak per rank, stacked; the label is the peak of their sum",
                    mem_rows, cats, mem_vals, "B", mem_labels);
  if (!tput_rows.empty())  // none under bench --simulate
    o << "<h2>Throughput</h2>\n"
      << stacked_bars("chart-throughput", "median tokens/s after warm-up", tput_rows, {"tokens/s"}, tput_vals, "tok/s");
  o << "<h2>Communication per step, by collective kind (rank 0, bytes sent)</h2>\n"
    << stacked_bars("chart-comm", "bytes per step", comm_rows, kinds, comm_vals, "B");
  if (!gantt.str().empty()) o << "<h2>Pipeline timelines (last step, measured)</h2>\n" << gantt.str();
  if (!memtime.str().empty())
    o << "<h2>Memory over one step (the last, from its trace)</h2>\n<p>The ledger's bytes per category on each "
         "rank, sampled at the step's start, after each micro-batch's forward and backward, on each FSDP gather and "
         "release, on each ZeRO stripe's launch, after each pipeline action, and after the optimizer; ticks mark the "
         "samples.</p>\n"
      << memtime.str();
  o << "<h2>Measured and predicted</h2>\n<p>Rank 0; cells are predicted / measured (error). The planner's "
       "model states are exact: param is what the rank keeps between steps, with the peak while ZeRO-3/FSDP units "
       "are gathered; the bubble's prediction is the schedule's (p-1)/(v m); activations follow Korthikanti et "
       "al.'s formulas.</p>\n"
    << "<table id='table-layouts'><tr><th>layout</th><th>ranks</th><th>step</th><th>throughput</th><th>bubble</th>"
       "<th>param</th><th>optimizer</th><th>activation</th><th>bytes sent / step</th></tr>\n"
    << table.str() << "</table>\n";
  o << "<h2>Refused or failed layouts</h2>\n";
  if (refused.str().empty())
    o << "<p>None: every layout ran.</p>\n";
  else
    o << "<table id='table-refused'><tr><th>layout</th><th>ranks</th><th>status</th><th>reason</th></tr>\n"
      << refused.str() << "</table>\n";
  o << "</body></html>\n";
  return o.str();
}

}  // namespace sg::report
