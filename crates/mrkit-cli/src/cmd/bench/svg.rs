//! The SVG plots (log-log line charts drawn with plotters).

use std::path::Path;

use serde_json::Value;

use super::registration::{Floor, Point};
use crate::cmd::human;

pub(super) fn plot(
    path: &Path,
    title: &str,
    xlabel: &str,
    ylabel: &str,
    series: &[(&str, Vec<(u64, f64)>)],
) -> Result<(), String> {
    use plotters::prelude::*;
    let pts: Vec<(u64, f64)> = series.iter().flat_map(|(_, v)| v.iter().copied()).collect();
    if pts.is_empty() {
        return Err("no data".into());
    }
    let xmin = pts.iter().map(|p| p.0).min().unwrap_or(4096) as f64;
    let xmax = pts.iter().map(|p| p.0).max().unwrap_or(4096) as f64 * 1.5;
    let ymin = pts.iter().map(|p| p.1).fold(f64::MAX, f64::min).max(1e-3) / 1.5;
    let ymax = pts.iter().map(|p| p.1).fold(0.0, f64::max) * 1.5;
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((xmin..xmax).log_scale(), (ymin..ymax).log_scale())
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc(xlabel)
        .y_desc(ylabel)
        .x_label_formatter(&|x| human(*x as u64))
        .draw()
        .map_err(|e| e.to_string())?;
    let colors = [RED, BLUE, GREEN, MAGENTA, BLACK];
    for (i, (name, v)) in series.iter().enumerate() {
        let c = colors[i % colors.len()];
        chart
            .draw_series(LineSeries::new(
                v.iter().map(|(x, y)| (*x as f64, *y)),
                c.stroke_width(2),
            ))
            .map_err(|e| e.to_string())?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c));
        chart
            .draw_series(
                v.iter()
                    .map(|(x, y)| Circle::new((*x as f64, *y), 3, c.filled())),
            )
            .map_err(|e| e.to_string())?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

/// Bandwidth series for `data_bw.svg` (GB/s).
pub(super) fn data_path_series<'a>(
    dp_in: &Value,
    dp_two: &Value,
) -> Vec<(&'a str, Vec<(u64, f64)>)> {
    let pick = |rows: &Value, op: &str, key: &str, scale: f64| -> Vec<(u64, f64)> {
        rows.as_array()
            .into_iter()
            .flatten()
            .filter(|r| r["op"] == op)
            .filter_map(|r| Some((r["size"].as_u64()?, r[key].as_f64()? * scale)))
            .filter(|(_, y)| *y > 0.0)
            .collect()
    };
    let bw = &dp_in["bandwidth"];
    let two = &dp_two["result"]["mrkit"];
    vec![
        ("in-process WRITE", pick(bw, "write", "gbps", 1.0)),
        ("in-process READ", pick(bw, "read", "gbps", 1.0)),
        (
            "memcpy (same arenas)",
            pick(bw, "write", "memcpy_gbps", 1.0),
        ),
        (
            "two-process WRITE (RoCEv2/UDP)",
            pick(two, "write", "bw_mbps", 1e-3),
        ),
        (
            "two-process READ (RoCEv2/UDP)",
            pick(two, "read", "bw_mbps", 1e-3),
        ),
    ]
    .into_iter()
    .filter(|(_, v)| !v.is_empty())
    .collect()
}

/// Draw `reg_cost.svg`, `reg_throughput.svg` and `data_bw.svg` into `out`; a note for every
/// plot that could not be drawn.
pub(super) fn draw_plots(
    out: &Path,
    points: &[Point],
    floors: &[Floor],
    io_uring: bool,
    dp_in: &Value,
    dp_two: &Value,
) -> Vec<String> {
    let us = |v: Option<u64>| v.map(|n| n as f64 / 1e3);
    let series_of = |page: &str| -> Vec<(u64, f64)> {
        points
            .iter()
            .filter(|p| p.page == page)
            .filter_map(|p| us(p.reg_ns).map(|y| (p.size, y)))
            .collect()
    };
    let mut lat: Vec<(&str, Vec<(u64, f64)>)> = vec![
        ("reg_mr, 4 KiB pages", series_of("4k")),
        ("reg_mr, THP", series_of("thp")),
        (
            "mlock+munlock floor",
            floors
                .iter()
                .filter_map(|(s, m, _)| m.as_ref().ok().map(|n| (*s, *n as f64 / 1e3)))
                .collect(),
        ),
    ];
    if io_uring {
        lat.push((
            "io_uring pin floor",
            floors
                .iter()
                .filter_map(|(s, _, i)| {
                    i.as_ref()
                        .and_then(|r| r.as_ref().ok())
                        .map(|n| (*s, *n as f64 / 1e3))
                })
                .collect(),
        ));
    }
    let thr: Vec<(&str, Vec<(u64, f64)>)> = lat
        .iter()
        .map(|(n, v)| {
            (
                *n,
                v.iter()
                    .map(|(s, t)| (*s, *s as f64 / (1u64 << 30) as f64 / (t / 1e6)))
                    .collect(),
            )
        })
        .collect();
    let mut notes: Vec<String> = Vec::new();
    let dp_series = data_path_series(dp_in, dp_two);
    // (file, title, x label, y label, series)
    let plots = [
        (
            "reg_cost.svg",
            "registration cost vs size",
            "buffer size",
            "µs (median)",
            &lat,
        ),
        (
            "reg_throughput.svg",
            "registration throughput",
            "buffer size",
            "GiB/s",
            &thr,
        ),
        (
            "data_bw.svg",
            "WRITE/READ bandwidth vs message size",
            "message size",
            "GB/s (10^9 B/s)",
            &dp_series,
        ),
    ];
    for (file, title, x, y, series) in plots {
        if let Err(e) = plot(&out.join(file), title, x, y, series) {
            notes.push(format!("{file} not drawn: {e}"));
        }
    }
    notes
}
