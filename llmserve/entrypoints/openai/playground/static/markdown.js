"use strict";
// A small Markdown renderer for model output: headings, lists, quotes, paragraphs, fenced code blocks,
// inline code, bold, italics and http(s) links. Every piece of text is HTML-escaped before any markup
// is added, so the result holds only the tags made here: model output never runs as HTML.

const HTML_ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => HTML_ESCAPES[c]);
}

// `escaped` is already escaped: the patterns add tags around it and never let its text become markup
// (a link's address is escaped too, so it cannot leave its quotes, and must start with http(s)://).
function renderInline(escaped) {
  return escaped
    .split(/(`[^`\n]+`)/)
    .map((part, i) => {
      if (i % 2 === 1) return `<code>${part.slice(1, -1)}</code>`; // nothing inside code is formatted
      return part
        .replace(/\*\*([^*]+?)\*\*/g, "<strong>$1</strong>")
        .replace(/(^|[^*\w])([*_])([^*_\n]+)\2(?![*\w])/g, "$1<em>$3</em>")
        .replace(
          /\[([^\]]+)\]\((https?:\/\/[^\s()]+)\)/g,
          '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>',
        );
    })
    .join("");
}

function renderMarkdown(text) {
  const html = [];
  let paragraph = [];
  let list = null; // "ul" or "ol" while inside a list
  let code = null; // the lines of an open fenced block
  let language = "";

  const endParagraph = () => {
    if (paragraph.length) html.push(`<p>${paragraph.map(renderInline).join("<br>")}</p>`);
    paragraph = [];
  };
  const endList = () => {
    if (list) html.push(`</${list}>`);
    list = null;
  };
  const endCode = () => {
    const label = language ? ` data-language="${escapeHtml(language)}"` : "";
    html.push(`<pre${label}><code>${escapeHtml(code.join("\n"))}</code></pre>`);
    code = null;
  };
  const listItem = (kind, content) => {
    endParagraph();
    if (list !== kind) {
      endList();
      html.push(`<${kind}>`);
      list = kind;
    }
    html.push(`<li>${renderInline(content)}</li>`);
  };

  for (const raw of text.split("\n")) {
    const fence = /^\s*```\s*([\w+#.-]*)/.exec(raw);
    if (code !== null) {
      if (fence) endCode();
      else code.push(raw);
      continue;
    }
    if (fence) {
      endParagraph();
      endList();
      code = [];
      language = fence[1];
      continue;
    }
    const line = escapeHtml(raw);
    let m;
    if ((m = /^(#{1,6})\s+(.*)$/.exec(line))) {
      endParagraph();
      endList();
      html.push(`<h${m[1].length}>${renderInline(m[2])}</h${m[1].length}>`);
    } else if ((m = /^\s*[-*+]\s+(.*)$/.exec(line))) {
      listItem("ul", m[1]);
    } else if ((m = /^\s*\d+[.)]\s+(.*)$/.exec(line))) {
      listItem("ol", m[1]);
    } else if ((m = /^&gt;\s?(.*)$/.exec(line))) {
      endParagraph();
      endList();
      html.push(`<blockquote>${renderInline(m[1])}</blockquote>`);
    } else if (!line.trim()) {
      endParagraph();
      endList();
    } else {
      endList();
      paragraph.push(line);
    }
  }
  if (code !== null) endCode(); // a block still streaming in
  endParagraph();
  endList();
  return html.join("");
}
