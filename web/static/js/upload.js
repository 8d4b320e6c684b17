// Adapter upload with a progress bar (XHR reports upload progress; fetch does not), then status polling.
"use strict";
(() => {
  const form = document.getElementById("upload-form");
  if (!form) return;
  const bar = document.getElementById("upload-bar");
  const label = document.getElementById("upload-label");
  const button = form.querySelector("button[type=submit]");

  function pollStatus(url) {
    const timer = setInterval(async () => {
      try {
        const a = await (await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } })).json();
        label.textContent = `${a.name}: ${a.status}${a.failure_reason ? " – " + a.failure_reason : ""}`;
        if (a.status === "ready" || a.status === "failed") {
          clearInterval(timer);
          Console.flash(`Adapter ${a.name} is ${a.status}${a.failure_reason ? ": " + a.failure_reason : ""}.`, a.status === "ready" ? "ok" : "error");
          setTimeout(() => window.location.reload(), 600);
        }
      } catch (e) { /* keep polling through a restart */ }
    }, 700);
  }

  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const data = new FormData(form);
    const xhr = new XMLHttpRequest();
    xhr.open("POST", form.action);
    xhr.setRequestHeader("X-CSRF-Token", Console.csrf());
    xhr.setRequestHeader("Accept", "application/json");
    xhr.upload.onprogress = (e) => {
      if (!e.lengthComputable) return;
      const pct = Math.round((e.loaded / e.total) * 100);
      bar.style.width = `${pct}%`;
      label.textContent = `uploading ${pct}%`;
    };
    xhr.onload = () => {
      button.disabled = false;
      let body = {};
      try { body = JSON.parse(xhr.responseText); } catch (e) { /* not JSON */ }
      if (xhr.status >= 200 && xhr.status < 300) {
        bar.style.width = "100%";
        label.textContent = `${body.name}: ${body.status}`;
        pollStatus(body.status_url);
      } else {
        bar.style.width = "0";
        const msg = (body.error && body.error.message) || body.detail || `upload failed (${xhr.status})`;
        label.textContent = "";
        Console.flash(msg, "error");
      }
    };
    xhr.onerror = () => { button.disabled = false; Console.flash("Upload failed: network error.", "error"); };
    button.disabled = true;
    label.textContent = "uploading 0%";
    xhr.send(data);
  });
})();
